"""kiln.bench.offline against a fake engine that follows the LLMEngine contract."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from kiln.bench.offline import BenchRequest, run_latency, run_throughput, synthetic_requests
from kiln.runtime.outputs import RequestMetrics, RequestOutput


class FakeEngine:
    """One token per running request per step; at most ``max_batch`` requests run at once."""

    def __init__(self, vocab=100, max_seq_len=512, max_batch=4):
        self.spec = SimpleNamespace(
            model=SimpleNamespace(vocab_size=vocab),
            limits=SimpleNamespace(max_seq_len=max_seq_len, max_input_len=max_seq_len),
        )
        self.tokenizer = None
        self.max_batch = max_batch
        self.reqs = {}
        self.ids = itertools.count()
        self.prompts_seen = []

    def add_request(self, prompt, params=None, request_id=None):
        rid = request_id or f"r{next(self.ids)}"
        assert isinstance(prompt, list)
        self.prompts_seen.append(prompt)
        assert params.ignore_eos
        self.reqs[rid] = (prompt, params, [])
        return rid

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        outs = []
        for rid in list(self.reqs)[: self.max_batch]:
            prompt, params, toks = self.reqs[rid]
            toks.append(len(toks) % 7)
            fin = len(toks) >= params.max_tokens
            outs.append(RequestOutput(rid, prompt, list(toks), "x" * len(toks), [toks[-1]], "x",
                                      fin, "length" if fin else None, RequestMetrics(0.0)))
            if fin:
                del self.reqs[rid]
        return outs


def test_synthetic_requests_shapes_and_determinism():
    eng = FakeEngine(vocab=50)
    a = synthetic_requests(eng, 5, 12, 3, seed=7)
    b = synthetic_requests(eng, 5, 12, 3, seed=7)
    assert a == b
    assert len(a) == 5
    assert all(len(r.prompt_token_ids) == 12 and r.output_len == 3 for r in a)
    assert all(0 <= t < 50 for r in a for t in r.prompt_token_ids)
    assert synthetic_requests(eng, 5, 12, 3, seed=8) != a


def test_synthetic_requests_skip_special_ids():
    eng = FakeEngine(vocab=4)
    eng.tokenizer = SimpleNamespace(all_special_ids=[0, 1], __len__=None)
    reqs = synthetic_requests(eng, 3, 50, 1)
    assert {t for r in reqs for t in r.prompt_token_ids} <= {2, 3}


def test_lengths_checked_against_engine_limits():
    eng = FakeEngine(max_seq_len=64)
    with pytest.raises(ValueError, match="max_seq_len=64"):
        synthetic_requests(eng, 1, 60, 10)
    with pytest.raises(ValueError, match="num_prompts"):
        synthetic_requests(eng, 0, 8, 8)


def test_run_throughput_counts_every_token():
    eng = FakeEngine()
    seen = []
    r = run_throughput(eng, num_prompts=10, input_len=8, output_len=5, seed=0,
                       progress=seen.append)
    assert r["num_requests"] == 10
    assert r["output_tokens"] == 50
    assert r["prompt_tokens"] == 80
    assert sum(seen) == 50
    assert r["elapsed_s"] > 0
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert r[key] > 0
    assert r["total_tokens_per_s"] == pytest.approx(130 / r["elapsed_s"])
    assert r["ttft_s"]["count"] == 10
    assert not eng.has_unfinished_requests()


def test_run_throughput_counts_preemptions_of_finished_requests():
    """num_preemptions: the finished requests' preemptions summed (KV blocks ran out and
    they were recomputed), so a run's report says when its batch outgrew the KV pool."""

    class Preempting(FakeEngine):
        def step(self):
            outs = super().step()
            for o in outs:
                o.metrics.num_preemptions = 2 if o.finished and o.request_id in ("r1", "r4") else 0
            return outs

    r = run_throughput(Preempting(), num_prompts=6, input_len=4, output_len=3, warmup=False)
    assert r["num_preemptions"] == 4
    assert run_throughput(FakeEngine(), num_prompts=3, input_len=4, output_len=3,
                          warmup=False)["num_preemptions"] == 0


def test_run_throughput_with_given_requests():
    eng = FakeEngine()
    reqs = [BenchRequest([1, 2, 3], 2), BenchRequest([4], 6)]
    r = run_throughput(eng, requests=reqs, warmup=False)
    assert r["output_tokens"] == 8
    assert r["prompt_tokens"] == 4
    assert r["config"]["source"] == "dataset"


def test_run_latency_reports_summaries():
    eng = FakeEngine()
    ticks = []
    r = run_latency(eng, batch_size=2, input_len=4, output_len=6, num_iters=3, warmup=1,
                    progress=ticks.append)
    assert len(r["iterations"]) == 3 and sum(ticks) == 3
    # 1 warm-up + 3 timed iterations, 2 prompts each
    assert len(eng.prompts_seen) == 8
    for key in ("latency_s", "ttft_s", "tpot_s", "e2e_s"):
        s = r[key]
        assert set(s) >= {"mean", "median", "p90", "p99"}
    assert r["ttft_s"]["count"] == 6 and r["tpot_s"]["count"] == 6
    assert r["latency_s"]["count"] == 3
    assert all(it["output_tokens"] == 12 for it in r["iterations"])


def test_run_latency_validates_arguments():
    eng = FakeEngine()
    with pytest.raises(ValueError, match="num_iters"):
        run_latency(eng, num_iters=0)
    with pytest.raises(ValueError, match="batch_size"):
        run_latency(eng, batch_size=0)


def test_speculative_report_renders_the_spread_and_bf16_differences():
    """render_speculative: a range column when runs were repeated; a bf16 difference is
    labelled as rounding, a float32 one as NO."""
    import io

    from rich.console import Console

    from kiln.bench.report import render_speculative

    def result(dtype, same):
        s = {"plain_tokens_per_s": 100.0, "spec_tokens_per_s": 120.0, "speedup": 1.2,
             "speedups": [1.1, 1.2, 1.3], "tokens_per_step": 2.0, "same_output": same}
        return {"config": {"mode": "lookahead", "engine_window": [7, 7, 7],
                           "request_window": None, "max_draft_len": 48, "output_len": 8,
                           "repeats": 3, "dtype": dtype}, "sets": {"code": s}}

    for dtype, same, want in (("bfloat16", False, "differs (bfloat16 rounding)"),
                              ("float32", False, "NO"), ("bfloat16", True, "yes")):
        buf = io.StringIO()
        render_speculative(result(dtype, same), Console(file=buf, width=200))
        text = buf.getvalue()
        assert "1.10-1.30x" in text and "median of 3 alternating runs" in text, text
        assert want in text, text
