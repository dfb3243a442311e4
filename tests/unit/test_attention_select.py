"""The attention backend per step class (kiln/runtime/layers/attention_select.py): the
problems a build times, the choice from timings, how the runtime follows engine.json
``attention``. The timings themselves need CUDA (tests/gpu/test_flash_attention_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.artifact.spec import EngineSpec, Limits
from kiln.builder.writer import _requested_attention
from kiln.config import ModelConfig
from kiln.runtime.layers import attention_select as sel
from kiln.runtime.layers.attention import step_class
from kiln.runtime.layers.attention_registry import get_backend
from kiln.runtime.layers.flash_attention import FlashAttention
from kiln.runtime.layers.triton_attention import TritonAttention
from kiln.runtime.startup import resolve_backend

CUDA = torch.device("cuda")
MEASURED = {"backend": "flash-attn", "source": "measured",
            "classes": {"decode": "triton", "prompt": "flash-attn", "tree": "triton"}}


def _model():
    return ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=8192)


def test_step_class():
    assert step_class(SimpleNamespace(mask=None, max_query_len=1)) == "decode"
    assert step_class(SimpleNamespace(mask=None, max_query_len=9)) == "prompt"
    assert step_class(SimpleNamespace(mask="packed", max_query_len=9)) == "tree"


def test_problems_at_the_engine_shapes():
    probs = sel.problems(_model(), Limits(64, 8448, 8192, 8192), tokens_per_step=15,
                         tree=True)
    by_name = {p["name"]: p for p in probs}
    assert [p["class"] for p in probs] == ["decode", "decode", "prompt", "prompt", "tree"]
    assert by_name["decode b1 ctx8000"]["seqs"] == [[7999, 1]]
    assert by_name["decode b64 ctx1024"]["seqs"] == [[1023, 1]] * 64
    assert by_name["prefill 8192"]["seqs"] == [[0, 8192]]
    mixed = by_name["mixed 1x512 + 63 decodes"]["seqs"]
    assert mixed == [[3584, 512]] + [[1023, 1]] * 63
    busy = sel.problems(_model(), Limits(256, 8448, 8192, 8192))[3]
    assert busy["name"] == "mixed 8x512 + 63 decodes"
    assert busy["seqs"][:2] == [[3584, 512], [0, 512]] and len(busy["seqs"]) == 71
    tree = by_name["tree b8 q15 ctx527"]
    assert tree["tree"] and tree["seqs"] == [[512, 15]] * 8
    # every problem fits the limits: a sequence within max_seq_len, a step within the budget
    small = Limits(1, 256, 200, 128)
    for p in sel.problems(_model(), small, tokens_per_step=15, tree=True):
        assert all(pre + n <= 256 for pre, n in p["seqs"])
        assert sum(n for _, n in p["seqs"]) <= 128
    assert "tree" not in {p["class"] for p in sel.problems(_model(), small)}


def _stats(**us):
    """{problem: {"class", "us"}} from keyword rows like prefill=(cls, {backend: us})."""
    return {name: {"class": cls, "us": t} for name, (cls, t) in us.items()}


def test_choose_takes_the_faster_backend_per_class():
    stats = _stats(d1=("decode", {"triton": 10.0, "flash-attn": 5.0}),
                   p1=("prompt", {"triton": 2500.0, "flash-attn": 950.0}),
                   p2=("prompt", {"triton": 350.0, "flash-attn": 150.0}),
                   t1=("tree", {"triton": 40.0}))
    # flash-attn-4 is faster at decode here but cannot run inside the decode graphs
    assert sel.choose(stats, ("triton", "flash-attn")) == {
        "decode": "triton", "prompt": "flash-attn", "tree": "triton"}
    assert sel.section_backend(sel.choose(stats, ("triton", "flash-attn"))) == "flash-attn"
    assert sel.choose(stats, ("triton",))["prompt"] == "triton"  # flash-attn skipped


def test_choose_needs_a_clear_win_over_the_whole_class():
    near = _stats(p1=("prompt", {"triton": 100.0, "flash-attn": 96.0}))
    assert sel.choose(near, ("triton", "flash-attn"))["prompt"] == "triton"
    # faster on one prompt problem, slower in sum: Triton
    split = _stats(p1=("prompt", {"triton": 100.0, "flash-attn": 50.0}),
                   p2=("prompt", {"triton": 100.0, "flash-attn": 200.0}))
    assert sel.choose(split, ("triton", "flash-attn"))["prompt"] == "triton"
    # a backend that missed a problem of the class is not chosen for it
    missed = _stats(p1=("prompt", {"triton": 100.0, "flash-attn": 10.0}),
                    p2=("prompt", {"triton": 100.0}))
    assert sel.choose(missed, ("triton", "flash-attn"))["prompt"] == "triton"
    assert sel.section_backend(sel.choose({}, ("triton",))) == "triton"


def test_build_flag_is_recorded_or_refused():
    assert _requested_attention("auto") == {}
    assert _requested_attention("flash-attn") == {"backend": "flash-attn",
                                                  "source": "--attention-backend"}
    with pytest.raises(ValueError, match=r"'flash_attn' is unknown.*auto.*'flash-attn'"):
        _requested_attention("flash_attn")


def test_runtime_follows_the_recorded_choice(monkeypatch):
    from kiln.runtime import kernels

    monkeypatch.setattr(kernels, "available", lambda: True)
    assert resolve_backend("auto", CUDA, MEASURED) == ("flash-attn", MEASURED["classes"])
    assert resolve_backend("auto", CUDA, {"backend": "torch", "source": "--attention-backend"}
                           ) == ("torch", None)
    # nothing measured, an older engine, or an unknown name: Triton on CUDA
    for rec in ({"backend": "auto", "source": "default"}, {}, None, {"backend": "nope"}):
        assert resolve_backend("auto", CUDA, rec) == ("triton", None)
    # an explicit runtime choice (KILN_ATTENTION_BACKEND) wins over the engine's
    assert resolve_backend("triton", CUDA, MEASURED) == ("triton", None)
    # off CUDA the recorded GPU choice does not apply
    assert resolve_backend("auto", torch.device("cpu"), MEASURED) == ("torch", None)
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert resolve_backend("auto", CUDA, MEASURED) == ("torch", None)


def test_flash_attn_runs_the_classes_it_won(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(7, 32, 128))
    decode = SimpleNamespace(max_query_len=1, mask=None)
    prompt = SimpleNamespace(max_query_len=7, mask=None)
    b = get_backend("flash-attn", {"decode": "flash-attn", "prompt": "triton", "tree": "triton"})
    assert isinstance(b, FlashAttention) and b.classes == ("decode",)
    b.varlen = lambda *a, **kw: None
    assert b.takes(q, q, decode) and not b.takes(q, q, prompt)
    default = get_backend("flash-attn")
    assert default.classes == ("prompt",)
    assert isinstance(get_backend("triton", MEASURED["classes"]), TritonAttention)


def test_engine_json_round_trip():
    spec = EngineSpec(format_version=1, kiln_version="0", model=_model(), dtype="bfloat16",
                      limits=Limits(8, 512, 256, 512))
    assert "attention" not in spec.to_dict()  # an engine built before the section
    assert EngineSpec.from_dict(spec.to_dict()).attention == {}
    rec = {**MEASURED, "stats": {"prefill 8192": {"class": "prompt", "us": {"triton": 1.0}}}}
    import dataclasses

    spec = dataclasses.replace(spec, attention=rec)
    assert EngineSpec.from_dict(spec.to_dict()).attention == rec
