"""A byte-level tokenizer built locally (no download) for random and tiny test models."""

from __future__ import annotations

from typing import Any

BYTE_SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIAL_TOKENS)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ByteLevel pre-tokenizes to)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def make_byte_tokenizer() -> Any:
    """A transformers fast tokenizer: id i < 256 is byte i; then <s>, </s>, <|im_start|>,
    <|im_end|> (256..259).

    ChatML chat template, eos ``</s>`` (257), bos ``<s>`` (256). Models using it may have a
    larger vocab; ids >= 260 have no text (decoding them is the runtime's concern).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        add_bos_token=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast
