"""XGrammarCompiler / XGrammarMatcher on the byte tokenizer with a larger model vocab."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

pytest.importorskip("xgrammar")

from kiln.runtime.guided import GuidedSpec
from kiln.runtime.guided.xgrammar_backend import XGrammarCompiler
from kiln.sources import make_byte_tokenizer

VOCAB = 512  # model vocab > the byte tokenizer's 260 ids
EOS = 257


@pytest.fixture(scope="module")
def tok():
    return make_byte_tokenizer()


@pytest.fixture()
def compiler(tok):
    return XGrammarCompiler(tok, VOCAB)


def walk(matcher, tok, seed: int, limit: int = 200) -> str:
    """Sample uniformly among allowed tokens until the grammar ends; returns the text."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(limit):
        mask = torch.zeros(VOCAB, dtype=torch.bool)
        matcher.fill_mask(mask)
        allowed = mask.nonzero().flatten()
        assert len(allowed) > 0
        assert not mask[260:].any(), "ids past the tokenizer must never be allowed"
        t = int(allowed[torch.randint(len(allowed), (1,), generator=g)])
        assert matcher.accept(t)
        if t == EOS:
            break
        out.append(t)
    assert matcher.is_terminated()
    return tok.decode(out)


# Strings are bounded with a pattern: xgrammar 0.2.9 lets raw control characters (invalid in
# strict JSON) into strings constrained only by maxLength.
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
                   "name": {"type": "string", "pattern": "^[a-z ]{0,5}$"}},
    "required": ["ok", "color", "name"],
    "additionalProperties": False,
}


def test_json_schema(compiler, tok):
    jsonschema = pytest.importorskip("jsonschema")
    spec = GuidedSpec("json_schema", json.dumps(SCHEMA))
    for seed in range(10):
        text = walk(compiler.compile(spec), tok, seed)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object(compiler, tok):
    for seed in range(5):
        assert isinstance(json.loads(walk(compiler.compile(GuidedSpec("json_object")), tok,
                                          seed, limit=2000)), dict)


def test_regex_choice_ebnf(compiler, tok):
    for seed in range(10):
        assert re.fullmatch(r"[0-9]{2,4}-[ab]", walk(
            compiler.compile(GuidedSpec("regex", r"[0-9]{2,4}-[ab]")), tok, seed))
        assert walk(compiler.compile(GuidedSpec("choice", ("yes", "no", 'a"b\\c'))), tok,
                    seed) in ("yes", "no", 'a"b\\c')
        assert walk(compiler.compile(GuidedSpec("grammar", 'root ::= "x" ("y" | "z")')),
                    tok, seed) in ("xy", "xz")


def test_reject_and_rollback(compiler, tok):
    m = compiler.compile(GuidedSpec("choice", ("ab", "cd")))
    assert not m.accept(ord("z"))
    assert m.accept(ord("a"))
    m.rollback(1)
    assert m.accept(ord("c")) and m.accept(ord("d"))
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    m.fill_mask(mask)
    assert mask.nonzero().flatten().tolist() == [EOS]


@pytest.mark.parametrize("spec, words", [
    (GuidedSpec("json_schema", '{"type": "nope"}'), ["json_schema", "nope"]),
    (GuidedSpec("json_schema", "{bad"), ["json_schema", "not valid JSON"]),
    (GuidedSpec("regex", "(abc"), ["regex", "parenthesis"]),
    (GuidedSpec("grammar", "root ::= "), ["grammar", "EBNF"]),
])
def test_bad_specs_raise_value_error(compiler, spec, words):
    with pytest.raises(ValueError) as e:
        compiler.compile(spec)
    for w in words:
        assert w in str(e.value)
    assert ".cc:" not in str(e.value)
    assert spec not in compiler._cache  # a failure is not cached


def test_cache_hit(compiler):
    spec = GuidedSpec("json_schema", json.dumps(SCHEMA))
    compiler.compile(spec)
    compiler.compile(spec)
    compiler.compile(GuidedSpec("json_schema", json.dumps(SCHEMA)))  # equal spec, new object
    assert compiler.num_compiles == 1
    compiler.compile(GuidedSpec("regex", "a+"))
    assert compiler.num_compiles == 2


def test_lru_evicts(tok):
    c = XGrammarCompiler(tok, VOCAB, cache_size=2)
    for p in ("a", "b", "c"):
        c.compile(GuidedSpec("regex", p))
    assert GuidedSpec("regex", "a") not in c._cache
    c.compile(GuidedSpec("regex", "c"))
    assert c.num_compiles == 3


def test_timeout_then_cache(tok, monkeypatch):
    c = XGrammarCompiler(tok, VOCAB, timeout_s=0.2)
    release = threading.Event()
    real = c._compile_now

    def slow(spec):
        release.wait(5)
        return real(spec)

    monkeypatch.setattr(c, "_compile_now", slow)
    spec = GuidedSpec("regex", "[a-z]+")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="timeout"):
        c.compile(spec)
    assert time.perf_counter() - t0 < 2
    release.set()
    c._cache[spec].result(timeout=5)  # the background compile finishes into the cache
    c.compile(spec)
    assert c.num_compiles == 1


def test_bad_constructor_args(tok):
    with pytest.raises(ValueError, match="timeout_s"):
        XGrammarCompiler(tok, VOCAB, timeout_s=0)


@pytest.mark.parametrize("spec", [GuidedSpec("regex", "[^\\x00-\\U0010ffff]"),
                                  GuidedSpec("grammar", "root ::= root")],
                         ids=["empty-class", "left-recursion"])
def test_a_grammar_that_matches_nothing_is_a_value_error(compiler, spec):
    """A grammar with no first token would fail its request at the first step (every logit
    masked): it is refused at compile time instead, so the server answers 400 naming it."""
    with pytest.raises(ValueError, match=f"^{spec.kind} matches no text"):
        compiler.compiled(spec)
