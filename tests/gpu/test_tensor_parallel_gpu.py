"""Tensor parallelism on CUDA. Skipped without CUDA.

- NCCL's collectives as the model group makes them (NVLink multicast off) are captured in a
  CUDA graph and replay on new inputs (one rank: NCCL refuses two ranks on one GPU; at one
  rank NCCL copies instead of launching its collective kernels, so bench's profiling of
  them is checked with two GPUs only).
- Two ranks on one GPU over gloo (``KILN_TP_BACKEND=gloo``, eager: gloo cannot be
  captured) run the CUDA engine's path (staged steps, the fused Triton layers on a rank's
  shard, the all-reduces between them): greedy tokens equal tp 1, float32.
- With one GPU, a tp-2 engine over NCCL is one clear error naming the GPUs it needs.
- With two GPUs or more, tp 2 over NCCL with CUDA graphs equals tp 1 too.

Run on the lent GPU:  python -m pytest -q -s tests/gpu/test_tensor_parallel_gpu.py
"""

from __future__ import annotations

import datetime

import pytest
import torch
from helpers import mixed_prompts

from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _run(engine_dir, prompts, **config):
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cuda", **config))
    try:
        outs = eng.generate(prompts, GREEDY)
        eng.blocks.check_all_free()
        graphs = eng.runner.graphs.num_replays if eng.runner.graphs is not None else 0
    finally:
        eng.close()
    return [o.token_ids for o in outs], graphs


def test_nccl_collectives_capture_in_a_cuda_graph():
    """The model group's all-reduce, column gather and broadcast, captured once and
    replayed on new inputs, equal eager results."""
    import torch.distributed as dist

    from kiln.runtime.parallel.group import NO_MULTICAST, TPGroup

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                          timeout=datetime.timedelta(seconds=30))
    group = TPGroup(0, 1, store, torch.device("cuda", 0))
    try:
        assert group.backend == "nccl" and group.capturable
        import os

        assert all(os.environ[k] == v for k, v in NO_MULTICAST.items())
        x = torch.randn(8, 64, device="cuda")
        buf = torch.zeros(128, dtype=torch.int32, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up, as CudaGraphRunner does
            group.all_reduce(x.clone())
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y = group.all_reduce(x * 2)
            g = group.gather_columns(y[:, :32])
            group.broadcast(buf)
            z = buf.float().sum() + g.sum()
        for seed in range(3):
            torch.manual_seed(seed)
            x.copy_(torch.randn_like(x))
            buf.copy_(torch.randint(0, 100, buf.shape, device="cuda", dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, x * 2)
            assert torch.equal(g, (x * 2)[:, :32])
            assert torch.allclose(z, buf.float().sum() + (x * 2)[:, :32].sum())
    finally:
        group.close()


NCCL_NEEDS_2 = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=NCCL_NEEDS_2)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_equals_tp1(tiny_reference, monkeypatch, arch, backend):
    """gloo: two ranks on one GPU, eager; nccl: one GPU each, with CUDA graphs."""
    monkeypatch.setenv("KILN_TP_BACKEND", backend)  # the follower inherits it
    _, one = tiny_reference(arch)
    _, two = tiny_reference(arch, tp=2)
    prompts = mixed_prompts()
    cfg = dict(attention_backend="triton", block_size=4, num_kv_blocks=64, max_num_tokens=16)
    want, _ = _run(one, prompts, **cfg)
    got, replays = _run(two, prompts, **cfg)
    assert got == want
    assert (replays > 0) == (backend == "nccl")  # gloo cannot be captured
    if backend == "nccl":  # bench's collectives find NCCL's kernels in the graph replays
        from kiln.bench.collectives import profile_collectives

        eng = LLMEngine.from_engine_dir(two, RuntimeConfig(device="cuda", **cfg))
        try:
            c = profile_collectives(eng, 2, 8, steps=4)
        finally:
            eng.close()
        assert c["all_reduce_calls_per_step"] == 5 and c["gather_calls_per_step"] == 1, c


def test_bench_latency_of_a_tp2_engine_on_one_gpu_over_gloo(tiny_reference, monkeypatch):
    """kiln bench latency's tp records on CUDA: both ranks' device peaks and the
    collectives per decode step."""
    from kiln.bench.collectives import profile_collectives

    monkeypatch.setenv("KILN_TP_BACKEND", "gloo")
    _, two = tiny_reference("llama", tp=2)
    eng = LLMEngine.from_engine_dir(two, RuntimeConfig(device="cuda", num_kv_blocks=64))
    try:
        c = profile_collectives(eng, 2, 8, steps=4)
        memory = eng.memory_by_rank()
    finally:
        eng.close()
    assert c["source"] == "gloo operations (rank 0)" and c["all_reduce_calls_per_step"] == 5, c
    assert len(memory) == 2 and all(m["device"].startswith("cuda") for m in memory), memory
    assert all(m["device_peak_bytes"] > 0 for m in memory), memory


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=NCCL_NEEDS_2)])
@pytest.mark.parametrize("mode", ["lookahead", "ngram"])
def test_tp2_device_speculation_equals_tp1_plain(tiny_reference, monkeypatch, mode, backend):
    """The speculation kernels on every rank (proposal, verification on the all-gathered
    logits, the accepted rows' KV moved in each rank's cache): greedy equals plain tp 1."""
    from kiln.artifact.speculative import SpeculativeConfig

    monkeypatch.setenv("KILN_TP_BACKEND", backend)
    spec = (SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None) if mode == "lookahead"
            else SpeculativeConfig.from_cli("ngram", None, 4, 2))
    kw = dict(max_seq_len=256, max_num_tokens=256, max_batch_size=8)
    _, one = tiny_reference("llama", **kw)
    _, two = tiny_reference("llama", tp=2, speculative=spec, **kw)
    prompts = [p + p[:6] + p for p in mixed_prompts()[1:4]] + [mixed_prompts()[0]]
    cfg = dict(attention_backend="triton", block_size=4, num_kv_blocks=128)
    want, _ = _run(one, prompts, **cfg)
    eng = LLMEngine.from_engine_dir(two, RuntimeConfig(device="cuda", device_speculation=True,
                                                       **cfg))
    try:
        assert eng.spec_worker.device is not None and eng.runner.spec_step.proposer.kernels
        outs = eng.generate(prompts, GREEDY)
        eng.blocks.check_all_free()
    finally:
        eng.close()
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.spec_tokens - o.metrics.spec_steps for o in outs) > 0


@pytest.mark.slow
def test_qwen25_05b_tp2_over_gloo_equals_tp1(tmp_path, monkeypatch):
    """Issue 30's first check on one GPU: random qwen2.5-0.5b (14 heads, 2 KV heads: one
    per rank), float32, the first 32 tokens of 4 prompts."""
    from kiln.builder import build_engine

    monkeypatch.setenv("KILN_TP_BACKEND", "gloo")
    kw = dict(dtype="float32", max_seq_len=512, max_num_tokens=512, max_batch_size=8,
              progress=False)
    build_engine("random:qwen2.5-0.5b", tmp_path / "one", **kw)
    build_engine("random:qwen2.5-0.5b", tmp_path / "two", tp=2, **kw)
    prompts = [p[:40] for p in mixed_prompts()[:4]]
    want, _ = _run(tmp_path / "one", prompts, attention_backend="triton", cuda_graphs=False)
    got, _ = _run(tmp_path / "two", prompts, attention_backend="triton")
    assert got == want


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host has the GPUs")
def test_tp2_over_nccl_on_one_gpu_is_one_clear_error(tiny_reference, monkeypatch):
    monkeypatch.delenv("KILN_TP_BACKEND", raising=False)
    _, two = tiny_reference("llama", tp=2)
    with pytest.raises(ValueError, match=r"runs 2 ranks .* one GPU each, but sees 1 GPU"):
        LLMEngine.from_engine_dir(two, RuntimeConfig(device="cuda"))
