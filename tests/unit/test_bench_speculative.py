"""`kiln bench latency`'s plain vs speculative comparison (kiln/bench/speculative.py).

A tiny float32 lookahead engine on the CPU runs every bundled prompt set at batch 1 and 2:
greedy speculative output must equal plain output, and every number the report prints
(tokens per step, engine steps, step cost) must be there and consistent. The graph-replay
ratio's arithmetic runs against a stand-in for the CUDA graph runner.
"""

from __future__ import annotations

import difflib
import io
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from kiln.artifact.speculative import SpeculativeConfig
from kiln.bench.prompts import AGENTIC_PROMPTS, GROUNDED_PROMPTS
from kiln.bench.speculative import (
    PROMPT_SETS,
    batch_groups,
    num_runs,
    replay_cost,
    run_speculative_latency,
)
from kiln.runtime.cuda_graph import Bucket, CudaGraphRunner
from kiln.runtime.engine import LLMEngine, RuntimeConfig


@pytest.fixture(scope="module")
def la_engine(tiny_reference):
    _, out = tiny_reference(
        "llama", max_seq_len=512, max_num_tokens=512, max_batch_size=4,
        speculative=SpeculativeConfig.from_cli("lookahead", "3,3,2", None, None))
    return LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))


@pytest.fixture(scope="module")
def result(la_engine):
    done = []
    res = run_speculative_latency(la_engine, output_len=8, prompts_per_set=1, warmup=0,
                                  progress=done.append, repeats=1, batch_sizes=(1, 2, 8))
    res["progress"] = sum(done)
    return res


def test_prompt_sets_are_grounded_code_chat_and_grounded_prompts_carry_their_input():
    assert list(PROMPT_SETS) == ["grounded", "code", "chat", "agentic"]
    assert len(GROUNDED_PROMPTS) >= 6
    for text in GROUNDED_PROMPTS:  # the code or data to copy from is in the prompt
        assert len(text.splitlines()) >= 6, text
        assert len(text) < 400, text  # fits a 512-token byte-tokenizer engine


def test_agentic_prompts_repeat_tasks_never_a_prompt():
    """Agentic turns: each task twice in a row with other arguments (what a cache of earlier
    answers drafts from), no prompt verbatim twice, each fitting the tiny engines."""
    assert len(AGENTIC_PROMPTS) == len(set(AGENTIC_PROMPTS)) >= 6
    for first, second in zip(AGENTIC_PROMPTS[::2], AGENTIC_PROMPTS[1::2]):
        assert difflib.SequenceMatcher(None, first, second).ratio() > 0.8, (first, second)
    assert all(len(text) < 400 for text in AGENTIC_PROMPTS)


def test_batch_groups_run_each_prompt_alone_at_1_and_cycle_the_set_above():
    texts = ["a", "b", "c"]
    assert batch_groups(texts, 1, 2) == [["a"], ["b"]]
    assert batch_groups(texts, 2, 1) == [["a", "b"]]
    assert batch_groups(texts, 5, 1) == [["a", "b", "c", "a", "b"]]


def test_every_set_reports_both_batch_sizes_with_equal_output(result, la_engine):
    cfg = result["config"]
    assert cfg["batch_sizes"] == [1, 2] and cfg["skipped_batch_sizes"] == [8]
    assert result["progress"] == num_runs(la_engine, 1, (1, 2, 8)) == 8  # 4 sets x 2 sizes
    assert list(result["sets"]) == ["grounded", "code", "chat", "agentic"]
    for name, s in result["sets"].items():
        assert set(s["batches"]) == {"1", "2"}, name
        for batch, b in s["batches"].items():
            where = (name, batch)
            assert b["batch_size"] == int(batch)
            assert b["same_output"] is True, where  # greedy float32
            assert b["tokens_per_step"] >= 1, where
            assert b["plain_engine_steps"] > 0 and b["spec_engine_steps"] > 0, where
            assert b["plain_ms_per_step"] > 0 and b["spec_ms_per_step"] > 0, where
            ratio = b["step_cost_ratio"]
            assert isinstance(ratio, float) and ratio > 0, where
            assert ratio == pytest.approx(b["spec_ms_per_step"] / b["plain_ms_per_step"])
            assert b["speedup"] > 0 and len(b["speedups"]) == 1, where
            run = b["requests"][0]
            # speculative steps per request over engine steps; the prefill step never speculates
            spec = run["spec"]
            assert 0 < b["spec_step_fraction"] < 1, where
            assert b["spec_step_fraction"] == pytest.approx(
                spec["spec_steps"] / int(batch) / spec["engine_steps"]), where
            # engine steps that verified any draft: at least a request's share of them
            assert run["plain"]["masked_engine_steps"] == 0, where
            assert 0 < spec["masked_engine_steps"] <= spec["engine_steps"], where
            assert b["spec_step_fraction"] - 1e-9 <= b["masked_step_fraction"] < 1, where
            assert len(run["prompts"]) == int(batch), where
            # plain decoding takes a step per token; speculation commits several per step
            assert run["plain"]["spec_steps"] == 0, where
            assert run["plain"]["engine_steps"] >= run["plain"]["tokens"] / int(batch), where
            assert run["spec"]["spec_tokens"] >= run["spec"]["spec_steps"] > 0, where
            assert b["cache_share"] in (0, None), where  # lookahead keeps no such cache
        # the batch-1 numbers stay at the set's top level, as before batch sizes existed
        assert s["speedup"] == s["batches"]["1"]["speedup"]


def test_the_report_has_a_row_per_set_and_batch(result):
    from rich.console import Console

    from kiln.bench.report import render_speculative

    buf = io.StringIO()
    render_speculative(result, Console(file=buf, width=220))
    text = buf.getvalue()
    rows = [ln for ln in text.splitlines() if ln.lstrip("│ ").startswith(tuple(PROMPT_SETS))]
    assert len(rows) == 8, text  # 4 sets x 2 batch sizes
    assert "step cost" in text and "skipped batch 8" in text, text
    assert "NO" not in text and "graph replay" not in text, text
    replay = {"1": {"decode_ms": 0.5, "spec_ms": 0.95, "ratio": 1.9}}
    buf = io.StringIO()
    render_speculative({**result, "replay": replay}, Console(file=buf, width=220))
    assert "graph replay, speculative over decode step: batch 1 1.90x (0.500 -> 0.950 ms)" \
        in buf.getvalue(), buf.getvalue()
    replay["1"]["draft_ms"] = 0.1  # a draft-model engine's: its draft's decode step
    buf = io.StringIO()
    render_speculative({**result, "replay": replay}, Console(file=buf, width=220))
    assert "batch 1 1.90x (0.500 -> 0.950 ms, the draft's 0.100 ms a token)" \
        in buf.getvalue(), buf.getvalue()


def test_a_suffix_engine_reports_the_share_of_drafts_from_its_cache(tiny_reference):
    """The repeated runs of a set meet their own earlier answers in the cache: its share of
    the accepted drafts is reported, and printed under the table."""
    from rich.console import Console

    from kiln.bench.report import render_speculative

    _, out = tiny_reference("llama", max_seq_len=512, max_num_tokens=512, max_batch_size=4,
                            speculative=SpeculativeConfig.from_cli("suffix", max_draft_len=8))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    res = run_speculative_latency(eng, output_len=24, prompts_per_set=1, warmup=0, repeats=2,
                                  batch_sizes=(1,))
    shares = [s["batches"]["1"]["cache_share"] for s in res["sets"].values()]
    assert all(0 < x <= 1 for x in shares), shares
    buf = io.StringIO()
    render_speculative(res, Console(file=buf, width=220))
    assert "accepted draft tokens from the cache of earlier responses: grounded " \
        in buf.getvalue(), buf.getvalue()


def test_replay_cost_is_none_off_cuda(la_engine, result):
    assert result["replay"] is None
    assert replay_cost(la_engine) is None


class FakeGraphs:
    """The CUDA graph runner's bucket lookup and replay timing: decode buckets of 1, 2, 4
    sequences, masked buckets of 1 and 2 (as ``plan_buckets`` would make them); a replay
    costs 0.5 ms plus 0.01 ms per token."""

    def __init__(self, per_seq: int):
        self.buckets = [Bucket(s, s, False, 1, s) for s in (1, 2, 4)]
        self.buckets += [Bucket(s, s * per_seq, True, per_seq, s * per_seq) for s in (1, 2)]
        self.ready = set(self.buckets)
        self.timed: list[Bucket] = []

    find_bucket = CudaGraphRunner.find_bucket  # the real lookup over these buckets

    def replay_ms(self, b: Bucket, iters: int = 5) -> float:
        self.timed.append(b)
        return 0.5 + 0.01 * b.num_tokens


def _fake_engine(graphs, device="cuda"):
    spec = SpeculativeConfig.from_cli("lookahead", "3,3,2", None, None)
    return SimpleNamespace(runner=SimpleNamespace(graphs=graphs), device=torch.device(device),
                           speculative=spec)


def test_replay_cost_times_decode_and_masked_buckets_per_batch_size():
    graphs = FakeGraphs(per_seq=10)  # (3,3,2): (W+G)(N-1) = 10 tokens per sequence
    out = replay_cost(_fake_engine(graphs), batch_sizes=(1, 2, 4, 8))
    assert set(out) == {"1", "2"}  # no masked bucket of 4; no bucket at all of 8
    assert len(graphs.timed) == 4  # a batch size without both buckets times neither
    one, two = out["1"], out["2"]
    assert one["decode_ms"] == pytest.approx(0.51) and one["spec_ms"] == pytest.approx(0.6)
    assert one["ratio"] == pytest.approx(0.6 / 0.51)
    assert two["spec_bucket"] == [2, 20] and two["decode_bucket"] == [2, 2]
    assert two["ratio"] == pytest.approx(0.7 / 0.52)
    # a smaller request window fits the same masked buckets (they hold 10 tokens a sequence)
    small = replay_cost(_fake_engine(graphs), (1,), window=(2, 2, 1))
    assert small["1"]["spec_bucket"] == [1, 10]


def test_replay_cost_of_a_draft_model_step_counts_its_draft_decodes():
    """A draft-model step's replay is its verify step plus K of the draft's decode steps
    (the target's replay alone made a 7B/0.5B K=4 step look 1.06x a decode, not ~1.8x)."""
    target, draft = FakeGraphs(per_seq=5), FakeGraphs(per_seq=1)
    spec = SpeculativeConfig.from_cli("draft", max_draft_len=4, draft_model="small")
    eng = SimpleNamespace(
        runner=SimpleNamespace(graphs=target), device=torch.device("cuda"), speculative=spec,
        spec_worker=SimpleNamespace(draft_model=SimpleNamespace(
            runner=SimpleNamespace(graphs=draft))))
    one = replay_cost(eng, batch_sizes=(1,))["1"]
    assert one["draft_ms"] == pytest.approx(0.51)  # the draft's 1-sequence decode bucket
    assert one["spec_ms"] == pytest.approx(0.55 + 4 * 0.51)
    assert one["ratio"] == pytest.approx((0.55 + 4 * 0.51) / 0.51)
    eng.spec_worker.draft_model.runner.graphs = None
    assert replay_cost(eng) is None


def test_replay_cost_is_none_without_graphs_or_off_cuda():
    assert replay_cost(_fake_engine(None)) is None
    assert replay_cost(_fake_engine(FakeGraphs(10), device="cpu")) is None


@pytest.mark.parametrize("bad", ["0", "a", "1,,8", "-2"])
def test_spec_batch_sizes_must_be_positive_integers(bad):
    from kiln.cli.app import app

    proc = CliRunner().invoke(app, ["bench", "latency", "no-such-engine",
                                    "--spec-batch-sizes", bad])
    assert proc.exit_code == 2, proc.output
    out = " ".join(proc.output.split())
    assert "--spec-batch-sizes" in out and repr(bad) in out, out
    assert "integers >= 1" in out, out


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.1"])
def test_spec_top_p_must_be_a_mass_in_zero_one(bad):
    from kiln.cli.app import app

    proc = CliRunner().invoke(app, ["bench", "latency", "no-such-engine", "--spec-top-p", bad])
    assert proc.exit_code == 2, proc.output
    out = " ".join(proc.output.split())
    assert "--spec-top-p" in out and "(0, 1]" in out, out


def test_run_speculative_latency_rejects_bad_batch_sizes(la_engine):
    with pytest.raises(ValueError, match="integers >= 1"):
        run_speculative_latency(la_engine, output_len=2, batch_sizes=(0,))


def test_a_sampled_comparison_reports_rates_and_no_output_check(la_engine):
    """--spec-temperature: both runs sample; their texts differ by design, so the report
    says n/a where a greedy run checks the outputs, and the config records it."""
    from rich.console import Console

    from kiln.bench.report import render_speculative

    res = run_speculative_latency(la_engine, output_len=6, prompts_per_set=1, warmup=0,
                                  batch_sizes=(1,), temperature=0.8, top_p=0.9)
    cfg = res["config"]
    assert cfg["temperature"] == 0.8 and cfg["top_p"] == 0.9 and cfg["greedy"] is False
    for s in res["sets"].values():
        assert s["same_output"] is None and s["plain_tokens_per_s"] > 0
    buf = io.StringIO()
    render_speculative(res, Console(file=buf, width=220))
    out = buf.getvalue()
    assert "n/a (sampled)" in out and "NO" not in out
    assert "temperature 0.8, top_p 0.9" in out and "greedy" not in out
    with pytest.raises(ValueError, match="temperature"):
        run_speculative_latency(la_engine, output_len=2, temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p=1\.5 must be in \(0, 1\]"):
        run_speculative_latency(la_engine, output_len=2, temperature=0.8, top_p=1.5)
