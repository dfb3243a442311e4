"""Incremental detokenization and stop strings."""

from __future__ import annotations

from kiln.runtime.request import Request

# Tokens of context decoded before the new ones, so tokenizers that drop a leading space
# (sentencepiece) or merge bytes across tokens produce the right delta.
_CONTEXT = 5


class Detokenizer:
    """Appends the text of newly generated tokens to ``req.text`` without re-decoding all."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_len = len(tokenizer)
        self._fast = _fast_decode(tokenizer, self.vocab_len)

    def init_request(self, req: Request) -> None:
        req.read_offset = req.num_prompt_tokens
        req.prefix_offset = max(req.read_offset - _CONTEXT, 0)

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Random-weight engines may emit ids past the tokenizer's vocabulary: they have no text.
        ids = [i for i in ids if i < self.vocab_len]
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def update(self, req: Request, final: bool = False) -> None:
        """Extend ``req.text`` with whatever the new tokens completed; apply stop strings."""
        ids = req.all_token_ids
        if req.finish_reason == "stop" and isinstance(req.stop_reason, int):
            ids = ids[:-1]  # the eos / stop token itself has no text
        skip = req.params.skip_special_tokens
        prefix = self._decode(ids[req.prefix_offset : req.read_offset], skip)
        full = self._decode(ids[req.prefix_offset :], skip)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            old_len = len(req.text)
            req.text += full[len(prefix) :]
            req.prefix_offset, req.read_offset = req.read_offset, len(ids)
            self._check_stop_strings(req, old_len)

    @staticmethod
    def _check_stop_strings(req: Request, old_len: int) -> None:
        stops = req.params.stop
        if not stops:
            return
        longest = max(len(s) for s in stops)
        search_from = max(0, old_len - longest + 1)
        best = None
        for s in stops:
            i = req.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            req.text = req.text[: best[0]]
            if not req.is_finished or req.finish_reason == "length":
                req.finish("stop", best[1])


def _fast_decode(tokenizer, vocab_len: int):
    """The Rust tokenizer's own ``decode`` when it gives exactly the wrapper's text.

    transformers' ``decode`` adds ~10 us of Python per call (twice per request per step);
    some tokenizers also post-process (clean-up of spaces), so the backend is used only when
    it agrees with the wrapper on a probe of every 7th token id in windows of 6 and on a
    sentence with punctuation; otherwise None (the wrapper is used).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return None
    probes = [list(range(i, min(i + 6, vocab_len))) for i in range(0, vocab_len, 7 * 6)]
    try:
        probes.append(tokenizer.encode("Hello , world ! It ' s a test . Isn't it? (yes) - no",
                                       add_special_tokens=False))
        for ids in probes:
            if backend.decode(ids, skip_special_tokens=True) != tokenizer.decode(
                    ids, skip_special_tokens=True):
                return None
    except Exception:
        return None
    return backend.decode
