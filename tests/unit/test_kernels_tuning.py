"""Kernel tuning registry: tune (fake CPU kernel), install / lookup, paged_attention's key,
config plumbing (CPU interpreter) and the engine.json section."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest
import torch

from kiln.artifact.spec import EngineSpec, Limits
from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.kernels import tuning
from kiln.sources.random import PRESETS

TINY = PRESETS["tiny-llama"]
SECTION = {
    "tuned": True, "gpu": "Fake GPU 9000", "capability": [9, 0], "triton": "3.6.0",
    "torch": "2.11.0", "tuned_at": "2026-11-30", "tune_s": 1.5,
    "configs": {"fake": {"k": {"t": 0.5}}, "paged_attention": {}},
    "stats": {}, "skipped": {"fake": 1}, "rejected": {"fake": 1},
}


@pytest.fixture
def fake_kernel():
    """A CPU 'kernel' whose time per call is config['t'] x problem['n'] (deterministic);
    config 'bad' gives a different output, 'boom' fails to launch."""
    calls = []

    def run(p, c, device):
        calls.append(("run", p["n"], c["t"]))
        if c.get("boom"):
            raise RuntimeError("out of resources: shared memory")
        x = torch.arange(p["n"], dtype=torch.float32)
        return x * 1.1 if c.get("bad") else x.clone()

    t = tuning.Tunable(
        name="fake",
        problems=lambda target: [{"n": 4}, {"n": 8}, {"n": 3, "other": True}],
        key=lambda p: "j" if p.get("other") else "k",
        candidates=lambda p: [{"t": 0.9}, {"t": 0.5}, {"t": 0.1, "bad": True},
                              {"t": 0.05, "boom": True}, {"t": 0.99}],
        bench=lambda p, c, device: c["t"] * p["n"] * 1e-6,
        default=lambda p: {"t": 1.0},
        run=run,
        devices=("cpu",),
    )
    tuning.register(t)
    yield calls
    tuning._REGISTRY.pop("fake", None)
    tuning.clear()


def test_tune_picks_fastest_valid_config(fake_kernel):
    seen = []
    section = tuning.tune(TINY, Limits(), torch.float32, "cpu",
                          progress=lambda label, done, total: seen.append((done, total)),
                          kernels=["fake"])
    assert section["tuned"] is True and section["gpu"].startswith("cpu")
    assert {"capability", "triton", "torch", "tuned_at", "tune_s"} <= set(section)
    # 0.1 is faster but its output differs; 0.05 does not launch; 0.5 wins for both keys
    assert section["configs"] == {"fake": {"k": {"t": 0.5}, "j": {"t": 0.5}}}
    assert section["skipped"] == {"fake": 2} and section["rejected"] == {"fake": 2}
    stat = section["stats"]["fake"]["k"]
    assert stat["speedup"] == pytest.approx(2.0) and stat["default_us"] == [4.0, 8.0]
    assert seen[-1] == (12, 12) and [d for d, _ in seen] == list(range(1, 13))
    # a rejected config is checked against the default's output before it is ever timed
    assert ("run", 4, 0.1) in fake_kernel
    assert tuning.num_configs(section) == 2


def test_tune_keeps_default_within_margin(fake_kernel):
    t = tuning._REGISTRY["fake"]
    tuning.register(tuning.Tunable(**{**t.__dict__, "candidates": lambda p: [{"t": 0.99}]}))
    section = tuning.tune(TINY, Limits(), torch.float32, "cpu", kernels=["fake"])
    assert section["configs"]["fake"]["k"] == {"t": 1.0}  # 1% faster is noise


def test_tune_default_failing_leaves_key_untuned(fake_kernel):
    t = tuning._REGISTRY["fake"]
    tuning.register(tuning.Tunable(**{**t.__dict__, "default": lambda p: {"t": 1, "boom": 1}}))
    section = tuning.tune(TINY, Limits(), torch.float32, "cpu", kernels=["fake"])
    assert section["configs"] == {}
    assert "default config failed" in section["stats"]["fake"]["k"]["error"]


def test_builtin_tunables_do_not_run_on_cpu():
    names = set(tuning.registered())
    assert "paged_attention" in names
    section = tuning.tune(TINY, Limits(), torch.bfloat16, "cpu", kernels=["paged_attention"])
    assert section["configs"] == {} and section["tuned"] is True


def _identity(gpu, triton="3.6.1"):
    return lambda device: {"gpu": gpu, "capability": [9, 0], "triton": triton, "torch": "x"}


def test_install_and_lookup(monkeypatch, capsys):
    monkeypatch.setattr(tuning, "device_identity", _identity("Fake GPU 9000"))
    try:
        tuning.install(SECTION, "cuda")
        assert tuning.lookup("fake", "k") == {"t": 0.5}
        assert tuning.lookup("fake", "nope") is None and tuning.lookup("gemv", "k") is None
        assert capsys.readouterr().err == ""
        for section in (None, {}, {"tuned": False, "reason": "x"}):
            tuning.install(section, "cuda")
            assert tuning.lookup("fake", "k") is None
        tuning.install(SECTION, "cpu")  # tuned kernels are CUDA kernels
        assert tuning.lookup("fake", "k") is None
    finally:
        tuning.clear()


def test_install_other_gpu_warns_once_and_uses_defaults(monkeypatch, capsys):
    tuning._WARNED.clear()
    monkeypatch.setattr(tuning, "device_identity", _identity("NVIDIA H100 80GB HBM3"))
    tuning.install(SECTION, "cuda")
    assert tuning.lookup("fake", "k") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: ")
    assert "Fake GPU 9000" in err and "NVIDIA H100 80GB HBM3" in err and "default" in err
    tuning.install(SECTION, "cuda")
    assert capsys.readouterr().err == ""  # once
    monkeypatch.setattr(tuning, "device_identity", _identity("Fake GPU 9000", "3.4.0"))
    tuning.install(SECTION, "cuda")
    err = capsys.readouterr().err
    assert "triton 3.6" in err and "triton 3.4" in err and tuning.lookup("fake", "k") is None


def test_engine_json_round_trip_of_the_section():
    spec = EngineSpec(format_version=1, kiln_version="0", model=TINY, dtype="bfloat16",
                      limits=Limits(max_seq_len=512), kernel_configs=SECTION)
    again = EngineSpec.from_dict(spec.to_dict())
    assert again.kernel_configs == SECTION and again == spec


# ---- paged_attention ---------------------------------------------------------------------


def test_paged_attention_keys_and_problems():
    from kiln.runtime.kernels.paged_attention import tuning_key

    assert tuning_key(8, 4, 128, torch.bfloat16, torch.bfloat16, 1) == \
        "kvh8-qpk4-d128-bfloat16-kvbfloat16-decode"
    assert tuning_key(8, 4, 128, "bfloat16", torch.float8_e4m3fn, 15).endswith(
        "-kvfloat8_e4m3fn-multi")
    assert tuning_key(8, 4, 128, torch.bfloat16, torch.bfloat16, 16).endswith("-prefill")
    pa = tuning.registered()["paged_attention"]
    spec = SpeculativeConfig.from_cli("lookahead", lookahead_config="4,3,4")  # 16 per step
    target = tuning.TuneTarget(TINY, Limits(max_seq_len=512, max_batch_size=8,
                                            max_num_tokens=64), torch.bfloat16,
                               tokens_per_step=spec.tokens_per_step, tree_mask=True)
    probs = pa.problems(target)
    assert [(p["batch"], p["query_len"], p["tree"]) for p in probs] == [
        (1, 1, False), (8, 1, False), (1, 16, True), (4, 16, True)]  # 64 tokens // 16
    assert all(p["context"] == 512 for p in probs)
    keys = [pa.key(p) for p in probs]
    assert keys[0] == keys[1] and keys[2] == keys[3] and keys[0].endswith("decode")
    assert keys[2].endswith("tree")  # speculative steps: their own class and defaults
    assert tuning_key(8, 4, 128, torch.bfloat16, torch.bfloat16, 16, masked=True).endswith(
        "-tree")
    for p in (probs[0], probs[2]):
        cands = pa.candidates(p)
        assert pa.default(p) in cands and len(cands) == len(
            {tuple(sorted(c.items())) for c in cands})
    assert any("min_split_tiles" in c for c in pa.candidates(probs[2]))


def _tiny_batch():
    from kiln.runtime.kernels.testing import random_paged_batch

    torch.manual_seed(0)
    return random_paged_batch([(37, 1, False), (20, 1, False), (0, 1, False)], 4, 2, 16, 4,
                              torch.float32)


def test_paged_attention_config_changes_nothing_but_speed(monkeypatch):
    from kiln.runtime.kernels import paged_attention as pa

    b = _tiny_batch()
    kw = dict(max_query_len=1, max_context_len=38, **b.kwargs())
    default = pa.paged_attention(*b.args(), 0.25, **kw)
    used = []
    launch = pa._launch
    # _launch(..., config, rows)
    monkeypatch.setattr(pa, "_launch", lambda *a: (used.append(a[-2]), launch(*a))[1])
    other = {"BLOCK_N": 32, "num_warps": 2, "num_stages": 1, "tiles_per_split": 1}
    forced = pa.paged_attention(*b.args(), 0.25, config=other, **kw)
    assert used[-1] == other and tuning.close(forced, default)
    # installed for this shape's key: the wrapper looks it up at launch
    key = pa.tuning_key(2, 2, 16, torch.float32, torch.float32, 1)
    monkeypatch.setattr(tuning, "device_identity", _identity("Fake GPU 9000"))
    try:
        tuning.install({**SECTION, "triton": "3.6.1", "configs": {
            "paged_attention": {key: other}}}, "cuda")
        looked_up = pa.paged_attention(*b.args(), 0.25, **kw)
        assert used[-1] == other and torch.equal(looked_up, forced)
    finally:
        tuning.clear()
    pa.paged_attention(*b.args(), 0.25, **kw)
    assert used[-1] == pa.default_config(16)


# ---- gemv ----------------------------------------------------------------------------------


@pytest.mark.parametrize("weights_fp8", [False, True])
@pytest.mark.parametrize("lm_head_fp8", [False, True])
def test_gemv_problems_tune_the_lm_head_in_its_engine_dtype(weights_fp8, lm_head_fp8):
    """The tuned lm_head key is the one the runtime looks up: FP8 only with an FP8 lm_head
    (kiln build --quantize-lm-head), whatever the other linears are."""
    from kiln.runtime.kernels.gemv_configs import tuning_key

    gm = tuning.registered()["gemv"]
    target = tuning.TuneTarget(TINY, Limits(max_seq_len=64, max_batch_size=2,
                                            max_num_tokens=64), torch.bfloat16,
                               weights_fp8=weights_fp8, lm_head_fp8=lm_head_fp8)
    keys = {gm.key(p) for p in gm.problems(target)}
    head = tuning_key(1, TINY.vocab_size, TINY.hidden_size,
                      "fp8" if lm_head_fp8 else "bfloat16")
    assert head in keys
    qkv = tuning_key(1, TINY.q_size + 2 * TINY.kv_size, TINY.hidden_size,
                     "fp8" if weights_fp8 else "bfloat16")
    assert qkv in keys
