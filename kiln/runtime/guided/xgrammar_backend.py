"""The xgrammar structured-output backend: GuidedSpec -> compiled grammar -> per-request matcher.

Compilation runs on a worker thread and the caller waits at most ``timeout_s``; compiled
grammars (as futures) are kept in an LRU keyed by the spec, so a compilation that timed out
still lands in the cache when it finishes and a later identical request gets it for free.
Masks are filled on the CPU (xgrammar releases the GIL while filling); nothing here runs as a
device-side host callback: a host function the device waits on would need the GIL, which a
thread waiting on the device may hold.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kiln.errors import RequestError
from kiln.runtime.guided import GuidedCompiler, GuidedMatcher, GuidedSpec

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 128
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "; users need the rest.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _ebnf_for_choices(choices: tuple[str, ...]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes = EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarMatcher(GuidedMatcher):
    """One request's grammar state over an xgrammar ``GrammarMatcher``.

    Holds an int32 bitmask [1, ceil(V/32)] reused every step; ``fill_mask`` expands it into the
    engine's bool row [V].
    """

    def __init__(self, matcher: Any, vocab_size: int):
        import xgrammar as xgr

        self._m = matcher
        self._vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # int32 [1, ceil(V/32)]
        self._shifts = torch.arange(32, dtype=torch.int32)

    def fill_mask(self, mask: torch.Tensor) -> None:
        self._m.fill_next_token_bitmask(self._bitmask, 0)
        # bit j of word w allows token 32*w + j: [W] -> [W, 32] -> [W*32] -> [V]
        bits = (self._bitmask[0].unsqueeze(-1) >> self._shifts) & 1
        mask.copy_(bits.reshape(-1)[: self._vocab_size].bool())

    def accept(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XGrammarCompiler(GuidedCompiler):
    """Compiles GuidedSpecs with xgrammar for one tokenizer and model vocabulary.

    ``vocab_size`` is the model's (logits) vocabulary, which may exceed the tokenizer's; ids
    past the tokenizer are never allowed. JSON is compiled without free whitespace (compact
    separators) so a grammar-forced output stays short and cannot pad itself forever.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 cache_size: int = DEFAULT_CACHE_SIZE, max_threads: int = 4):
        import xgrammar as xgr

        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if cache_size < 1:
            raise ValueError(f"cache_size={cache_size} must be >= 1")
        stop = getattr(tokenizer, "eos_token_id", None)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=[stop] if stop is not None else None
        )
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kiln-grammar")
        self._cache: OrderedDict[GuidedSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0  # grammars actually compiled (cache misses)

    def _compile_now(self, spec: GuidedSpec) -> Any:
        """The CompiledGrammar for ``spec`` (runs on the worker thread); ValueError for one
        that allows no first token (it matches nothing: no output could satisfy it)."""
        compiled = self._compile_spec(spec)
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise ValueError(f"{spec.kind} matches no text this model can write (it allows "
                             "no first token); check the pattern")
        return compiled

    def _compile_spec(self, spec: GuidedSpec) -> Any:
        c = self._compiler
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json_schema":
            try:
                json.loads(spec.value)
            except ValueError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from e
            return c.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            return c.compile_grammar(_ebnf_for_choices(spec.value))
        if spec.kind == "structural_tag":
            return c.compile_structural_tag(spec.value)
        return c.compile_grammar(spec.value)  # "grammar": EBNF

    def _future(self, spec: GuidedSpec) -> Future:
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            self.num_compiles += 1
            fut = self._pool.submit(self._compile_now, spec)
            self._cache[spec] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def _forget(self, spec: GuidedSpec, fut: Future) -> None:
        with self._lock:
            if self._cache.get(spec) is fut:
                del self._cache[spec]

    def compiled(self, spec: GuidedSpec) -> Any:
        """The (cached) CompiledGrammar; RequestError for a bad grammar or a timeout (param
        None: the caller knows which request field held the grammar)."""
        fut = self._future(spec)
        try:
            return fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise RequestError(
                f"compiling the {spec.kind} grammar took longer than the {self.timeout_s:g}s "
                "compile timeout; simplify it (compilation continues in the background and a "
                "retry may hit the cache)"
            ) from None
        except Exception as e:
            self._forget(spec, fut)
            msg = _XGR_PREFIX.sub("", " ".join(str(e).split())) or type(e).__name__
            if isinstance(e, ValueError) and msg.startswith(spec.kind):
                raise RequestError(msg) from None
            raise RequestError(f"invalid {spec.kind}: {msg}") from None

    def compile(self, spec: GuidedSpec) -> GuidedMatcher:
        import xgrammar as xgr

        return XGrammarMatcher(xgr.GrammarMatcher(self.compiled(spec)), self.vocab_size)
