"""Tensor parallelism on the Triton path (CPU, TRITON_INTERPRET=1, gloo, float32): the path
every step of a CUDA engine takes. Rank 0 stages each step, sends its sizes and graph
bucket (``StagedStep``) and broadcasts the staged buffers; every rank runs the same bucket
(``ModelRunner.forward_staged``) through the fused layers with the all-reduces between
them. Greedy tokens equal the tp-1 torch reference, plain and with lookahead (tree masks
travel with the buffers).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; the followers inherit it

import pytest
from helpers import mixed_prompts

pytest.importorskip("triton")

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.parallel.control import StagedStep
from kiln.runtime.sampling_params import SamplingParams

LOOKAHEAD = SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None)


def _tokens(engine_dir, backend, prompts, params, graphs=False, device_state=False):
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        device="cpu", block_size=4, num_kv_blocks=96, max_num_tokens=40,
        attention_backend=backend, cuda_graphs=graphs, device_speculation=device_state))
    sent: list[StagedStep] = []
    if eng.tp is not None:  # count what rank 0 sends on the staged path
        leader = eng.runner.leader
        send = leader.send_staged
        leader.send_staged = lambda b, st, stager, n: (sent.append(StagedStep(b, st, n)),
                                                       send(b, st, stager, n))
    try:
        outs = eng.generate(prompts, params)
        eng.blocks.check_all_free()
        replays = eng.runner.graphs.num_replays if eng.runner.graphs is not None else 0
        assert (eng.spec_worker is not None and eng.spec_worker.device is not None) == (
            device_state and eng.speculative.mode != "none")
    finally:
        eng.close()
    _tokens.accepted = sum(o.metrics.spec_tokens - o.metrics.spec_steps for o in outs)
    return [o.token_ids for o in outs], sent, replays


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buckets"])
def test_tp2_triton_path_equals_tp1_torch(tiny_reference, graphs):
    """Chunked prefill (a 40-token budget), then decode; graph-buckets: the steps run as
    the captured buckets would (off CUDA, replay runs the bucket's forward)."""
    _, one = tiny_reference("llama", max_seq_len=128, max_num_tokens=256, max_batch_size=8)
    _, two = tiny_reference("llama", tp=2, max_seq_len=128, max_num_tokens=256,
                            max_batch_size=8)
    prompts = mixed_prompts()[:3]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want, _, _ = _tokens(one, "torch", prompts, params)
    got, sent, replays = _tokens(two, "triton", prompts, params, graphs)
    assert got == want
    assert sent  # every step went the staged way
    assert (replays > 0) == graphs
    assert any(s.bucket is not None for s in sent) == graphs


def test_tp2_triton_lookahead_equals_tp1_plain(tiny_reference):
    """Tree-masked steps: the masks follow the staged buffers (``mask_bytes``); accepted
    drafts' KV moves on every rank."""
    kw = dict(max_seq_len=128, max_num_tokens=256, max_batch_size=8)
    _, one = tiny_reference("qwen2", **kw)
    _, two = tiny_reference("qwen2", tp=2, speculative=LOOKAHEAD, **kw)
    prompts = [p + p[:6] + p for p in mixed_prompts()[1:2]] + [mixed_prompts()[0]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want, _, _ = _tokens(one, "torch", prompts, params)
    got, sent, _ = _tokens(two, "triton", prompts, params, graphs=True)
    assert got == want
    assert any(s.staged.mask_bytes > 0 for s in sent)


@pytest.mark.parametrize("mode", ["lookahead", "ngram"])
@pytest.mark.parametrize(("backend", "graphs"), [("triton", False), ("triton", True),
                                                 ("torch", False)],
                         ids=["eager", "graph-buckets", "unstaged"])
def test_tp2_device_speculation_equals_tp1_plain(tiny_reference, mode, backend, graphs):
    """Device speculation under tp: every rank holds the state (rank 0's host writes, admit
    and fold, are sent as ``StateCall``) and runs the proposal, the verification on the
    all-gathered logits and the KV move of the accepted rows inside its own steps (staged)
    or around the forward rank 0 sends (unstaged: the torch backend's path, ``Forward``
    with the plans' entries). Greedy output equals plain tp 1, with drafts accepted on the
    device."""
    spec = (LOOKAHEAD if mode == "lookahead"
            else SpeculativeConfig.from_cli("ngram", None, 4, 2))
    kw = dict(max_seq_len=128, max_num_tokens=256, max_batch_size=8)
    _, one = tiny_reference("llama", **kw)
    _, two = tiny_reference("llama", tp=2, speculative=spec, **kw)
    # repeats, so that prompt lookup and the n-gram pool find drafts
    prompts = [p + p[:6] + p for p in mixed_prompts()[1:3]] + [mixed_prompts()[0]]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want, _, _ = _tokens(one, "torch", prompts, params)
    got, sent, _ = _tokens(two, backend, prompts, params, graphs, device_state=True)
    assert got == want
    assert any(s.num_entries > 0 for s in sent) == (backend == "triton")  # staged plans
    assert _tokens.accepted > 0  # drafts accepted
