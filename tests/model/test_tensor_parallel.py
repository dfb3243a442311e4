"""Tensor parallelism on the CPU (gloo, float32): a tp-N engine's greedy output equals the
tp-1 engine's token for token, alone and in a batch with chunked prefill and preemption,
and with lookahead and prompt lookup; a rank that dies or hangs ends the engine with an error naming it, and
no rank process is left behind.

Each tp engine starts N-1 follower processes (about 1.5 s each on a 2-core machine).
The tiny models use a large init std (0.2, conftest ``tiny_reference``): logits sit far from
ties, where the all-reduce's different summation order (float32, ~1e-7) could flip a token.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import mixed_prompts

from kiln.artifact.loader import load_engine
from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.parallel import Ranks, TensorParallelError
from kiln.runtime.parallel.worker import follow_launched
from kiln.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
LOOKAHEAD = SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None)
NGRAM = SpeculativeConfig.from_cli("ngram", None, 4, 2)
# 8 mixed-length prompts, a 16-token budget (chunked prefill) and a cache far too small for
# all of them (recompute preemption)
SMALL = dict(device="cpu", block_size=4, num_kv_blocks=32, max_num_tokens=16, reserve_kv=False)


def _run(engine_dir, prompts, params=GREEDY, **config):
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(**config))
    try:
        outs = eng.generate(prompts, params)
        eng.blocks.check_all_free()
        procs = list(eng.tp.procs) if eng.tp is not None else []
    finally:
        eng.close()
    assert all(p.returncode == 0 for p in procs)  # every follower left on Stop
    return outs


@pytest.mark.parametrize(("arch", "tp"), [("llama", 2), ("qwen2", 2), ("llama", 4)],
                         ids=["llama-tp2", "qwen2-bias-tp2", "llama-tp4-kv-replicated"])
def test_tp_greedy_equals_tp1_alone_and_in_a_preempting_batch(tiny_reference, arch, tp):
    _, one = tiny_reference(arch)
    _, many = tiny_reference(arch, tp=tp)
    prompts = mixed_prompts()
    want = [o.token_ids for o in _run(one, prompts[:2], device="cpu")]
    assert [o.token_ids for o in _run(many, prompts[:2], device="cpu")] == want
    want = _run(one, prompts, **SMALL)
    got = _run(many, prompts, **SMALL)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.num_preemptions for o in got) > 0


@pytest.mark.parametrize("speculative", [LOOKAHEAD, NGRAM], ids=["lookahead", "ngram"])
def test_tp_speculative_equals_tp1(tiny_reference, speculative):
    """Accepted draft tokens move their KV (``KVCache.move_slots``) on every rank: a tp-2
    speculative engine's greedy output is plain tp-1 greedy, with drafts accepted."""
    _, one = tiny_reference("llama")
    _, two = tiny_reference("llama", tp=2, speculative=speculative)
    prompts = mixed_prompts()[:4]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want = _run(one, prompts, params, device="cpu")
    got = _run(two, prompts, params, device="cpu", block_size=4)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.spec_tokens - o.metrics.spec_steps for o in got) > 0  # accepted


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped yet, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_killed_rank_ends_the_engine_with_its_name(tiny_reference):
    _, engine_dir = tiny_reference("llama", tp=4)
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu"))
    pids = [p.pid for p in eng.tp.procs]
    try:
        eng.add_request(mixed_prompts()[0], GREEDY)
        eng.step()
        os.kill(pids[1], signal.SIGKILL)  # rank 2
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 2 \(pid \d+\) was killed by "
                           r"signal SIGKILL.*every rank was ended"):
            while eng.has_unfinished_requests():
                eng.step()
        assert time.monotonic() - t0 < 10
        assert not any(_alive(pid) for pid in pids)
    finally:
        eng.close()


def test_a_hung_rank_times_out_instead_of_hanging(tiny_reference, monkeypatch):
    """A stopped (SIGSTOP) follower never joins the all-reduce: rank 0's collective times
    out (COLLECTIVE_TIMEOUT_S, shortened here) and every rank is ended."""
    from kiln.runtime.parallel import group

    monkeypatch.setattr(group, "COLLECTIVE_TIMEOUT_S", 2)  # rank 0's own group only
    _, engine_dir = tiny_reference("llama", tp=2)
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu"))
    (proc,) = eng.tp.procs
    try:
        eng.add_request(mixed_prompts()[0], GREEDY)
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"a collective failed.*[Tt]imed out"):
            while eng.has_unfinished_requests():
                eng.step()
        assert time.monotonic() - t0 < 10
        assert proc.poll() is not None
    finally:
        if proc.poll() is None:
            proc.kill()
        eng.close()


def _wait(cond, timeout_s: float) -> float:
    """Seconds until ``cond()`` held; AssertionError after ``timeout_s``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_heartbeats_find_a_rank_stopped_while_idle_and_no_healthy_one(tiny_reference,
                                                                      monkeypatch):
    """Heartbeat timeout 2 s: a healthy engine idles 4 s and then generates without a
    false alarm; a follower stopped (SIGSTOP) while the engine idles is found by its
    missing beats within the timeout (no step runs), the listeners hear it from the
    supervisor's thread, the follower is ended, and the next step raises the same error."""
    monkeypatch.setenv("KILN_TP_HEARTBEAT_TIMEOUT_S", "2")
    _, engine_dir = tiny_reference("llama", tp=2)
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu"))
    (proc,) = eng.tp.procs
    heard: list[BaseException] = []
    eng.on_failure(heard.append)
    try:
        time.sleep(4)
        assert eng.generate([mixed_prompts()[0]], GREEDY)[0].token_ids
        assert heard == [] and eng.tp.failed is None and proc.poll() is None
        os.kill(proc.pid, signal.SIGSTOP)
        took = _wait(lambda: heard, 6)
        assert 1.5 < took < 4, took
        (err,) = heard
        assert isinstance(err, TensorParallelError)
        assert re.search(r"rank 1 sent no heartbeat for 2\.\d s \(hung or stopped; "
                         r"KILN_TP_HEARTBEAT_TIMEOUT_S=2\); every rank was ended", str(err))
        assert proc.poll() == -signal.SIGKILL
        eng.add_request(mixed_prompts()[0], GREEDY)
        with pytest.raises(TensorParallelError, match="rank 1 sent no heartbeat"):
            eng.step()
    finally:
        if proc.poll() is None:
            proc.kill()
        eng.close()


def test_a_rank_stopped_mid_step_is_ended_while_rank0_waits_in_a_collective(tiny_reference,
                                                                            monkeypatch):
    """The follower stops (SIGSTOP) and rank 0's next step blocks in the collective that
    hands it the forward (its own timeout is 30 s): the supervisor, on its own thread,
    finds the missing beats and ends the follower, which unblocks rank 0's collective, and
    the step raises the supervisor's error well before the collective timeout."""
    monkeypatch.setenv("KILN_TP_HEARTBEAT_TIMEOUT_S", "2")
    _, engine_dir = tiny_reference("llama", tp=2)
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu"))
    (proc,) = eng.tp.procs
    try:
        eng.add_request(mixed_prompts()[0], GREEDY)
        eng.step()
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1 sent no heartbeat"):
            while eng.has_unfinished_requests():
                eng.step()
        assert time.monotonic() - t0 < 6
        assert proc.poll() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        eng.close()


def test_exit_on_failure_ends_a_rank0_that_cannot_stop(tiny_reference):
    """A process that armed ``exit_on_failure`` (the CLI does) and whose main thread never
    returns after a rank died (as one blocked in a collective inside a CUDA graph would
    not): the supervisor ends it with exit code 1 after the grace, naming the rank, and
    no follower is left."""
    _, engine_dir = tiny_reference("llama", tp=2)
    code = ("import threading; from kiln.runtime.engine import LLMEngine, RuntimeConfig; "
            f"e = LLMEngine.from_engine_dir({str(engine_dir)!r}, RuntimeConfig(device='cpu')); "
            "e.tp.exit_on_failure(1.0); print(*[p.pid for p in e.tp.procs], flush=True); "
            "threading.Event().wait()")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        (pid,) = [int(p) for p in leader.stdout.readline().split()]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert leader.wait(10) == 1
        assert 0.9 < time.monotonic() - t0 < 5
        err = leader.stderr.read()
        assert re.search(r"error: tensor-parallel engine \(tp=2\) stopped: rank 1 \(pid \d+\) "
                         r"was killed by signal SIGKILL; rank 0 did not stop within 1 s", err), err
    finally:
        leader.kill()
        leader.wait()


def test_memory_by_rank_is_each_rank_process_own(tiny_reference):
    """``memory_by_rank``: the follower's entry is its own process's peak RSS (its VmHWM),
    sent over the control channel, and the engine goes on afterwards."""
    _, engine_dir = tiny_reference("llama", tp=2)
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu"))
    try:
        zero, one = eng.memory_by_rank()

        def hwm(pid: int) -> int:  # the process's peak RSS as the kernel reports it
            status = Path(f"/proc/{pid}/status").read_text()
            return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024

        # rank 0 is this test process (its peak is the test run's history); the
        # follower's is its own process's
        assert zero["peak_rss_bytes"] > 50 * 2**20
        assert 0.95 * hwm(eng.tp.procs[0].pid) <= one["peak_rss_bytes"] <= hwm(
            eng.tp.procs[0].pid), one
        assert eng.generate([mixed_prompts()[0]], GREEDY)[0].token_ids
    finally:
        eng.close()


def test_a_rank_that_fails_at_start_is_named(tiny_reference, tmp_path):
    """A follower that cannot load its shard: rank 0 reports the follower's own error."""
    _, engine_dir = tiny_reference("llama", tp=2)
    spec = load_engine(engine_dir).spec
    broken = tmp_path / "broken"
    shutil.copytree(engine_dir, broken)
    (broken / spec.parallel.shards[1]).unlink()
    with pytest.raises(TensorParallelError, match=r"rank 1 failed: EngineFormatError: engine "
                       r".*broken is missing its weights file weights-rank1-of-2"):
        Ranks.start(broken, spec.parallel, spec.model, torch.device("cpu"),
                    RuntimeConfig(device="cpu"), follow=follow_launched)


def test_tp1_engines_never_load_the_parallel_package(tiny_reference):
    """tp 1 is today's path: no process group, no kiln.runtime.parallel import."""
    _, engine_dir = tiny_reference("llama")
    code = ("import sys; from kiln.runtime.engine import LLMEngine, RuntimeConfig; "
            "from kiln.runtime.sampling_params import SamplingParams; "
            f"e = LLMEngine.from_engine_dir({str(engine_dir)!r}, RuntimeConfig(device='cpu')); "
            "e.generate([[1, 2, 3]], SamplingParams(max_tokens=2)); e.close(); "
            "import torch.distributed as d; "
            "print('kiln.runtime.parallel' in sys.modules, d.is_initialized())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


@pytest.mark.slow
def test_smollm2_tp3_equals_tp1(smollm2_gguf, tmp_path):
    """The real smollm2-135m: 9 query heads and 3 KV heads split over 3 ranks (3 query
    heads and 1 KV head each; --tp 2 is a build error, test_tp_build.py), vocabulary 49152
    without pad. 4 chat prompts (~45 tokens, 24 more each) in a batch with chunked prefill
    and a 192-token cache (preemption)."""
    from kiln.bench.prompts import CHAT_PROMPTS, CODE_PROMPTS
    from kiln.builder import build_engine

    opts = dict(dtype="float32", max_seq_len=192, progress=False, tune=False)
    build_engine("smollm2-135m", tmp_path / "tp1", **opts)
    spec = build_engine("smollm2-135m", tmp_path / "tp3", tp=3, **opts)
    assert spec.parallel.kv_heads == "split" and spec.parallel.vocab_size_padded == 49152
    small = dict(device="cpu", block_size=4, num_kv_blocks=48, max_num_tokens=32,
                 reserve_kv=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    eng = LLMEngine.from_engine_dir(tmp_path / "tp1", RuntimeConfig(device="cpu"))
    prompts = [eng.apply_chat_template([{"role": "user", "content": p}])
               for p in (CODE_PROMPTS[0], CHAT_PROMPTS[0], CHAT_PROMPTS[2], CODE_PROMPTS[2])]
    eng.close()
    want = _run(tmp_path / "tp1", prompts, params, **small)
    got = _run(tmp_path / "tp3", prompts, params, **small)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.num_preemptions for o in got) > 0


def test_fp8_tp2_equals_tp1_with_static_scales(tiny_reference_source, tmp_path):
    """FP8 linears (per-tensor weight scales kept on every shard, static activation
    scales), an FP8 KV cache and an FP8 lm_head (per-row scales sharded with their rows):
    tp 2 == tp 1. (With dynamic activation scales each rank's row-parallel input has its
    own amax, so tp 2 rounds differently from tp 1, as in vLLM.)"""
    from helpers import write_compressed_tensors

    from kiln.artifact.spec import QuantConfig
    from kiln.builder import build_engine

    _, src = tiny_reference_source("qwen2")
    ckpt = write_compressed_tensors(src, tmp_path / "ct", dynamic=False, kv=True)
    opts = dict(dtype="float32", max_seq_len=128, progress=False, tune=False,
                quantization=QuantConfig(lm_head="fp8"))
    build_engine(str(ckpt), tmp_path / "tp1", **opts)
    spec = build_engine(str(ckpt), tmp_path / "tp2", tp=2, **opts)
    assert (spec.quantization.weights, spec.quantization.kv_cache) == ("fp8", "fp8")
    prompts = mixed_prompts()[:4]
    want = _run(tmp_path / "tp1", prompts, device="cpu")
    got = _run(tmp_path / "tp2", prompts, device="cpu")
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_followers_end_when_rank0_is_killed(tiny_reference):
    """Rank 0's process killed (SIGKILL: no cleanup) while its engine idles: the followers,
    waiting for its next command, end within seconds."""
    _, engine_dir = tiny_reference("llama", tp=2)
    code = ("import sys, time; from kiln.runtime.engine import LLMEngine, RuntimeConfig; "
            f"e = LLMEngine.from_engine_dir({str(engine_dir)!r}, RuntimeConfig(device='cpu')); "
            "print(*[p.pid for p in e.tp.procs], flush=True); time.sleep(120)")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        pids = [int(p) for p in leader.stdout.readline().split()]
        assert len(pids) == 1 and all(_alive(p) for p in pids)
        leader.kill()
        leader.wait()
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        leader.kill()
        leader.wait()
