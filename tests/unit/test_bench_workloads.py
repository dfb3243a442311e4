"""kiln.bench.workloads: TensorRT-LLM's published workloads by name, the checks made before
the engine loads, and one record per workload (against a fake engine: no model runs)."""

from __future__ import annotations

import contextlib
import itertools
from types import SimpleNamespace

import pytest

from kiln.artifact.spec import Limits
from kiln.bench.workloads import (
    WORKLOADS,
    card_of,
    check_engine,
    is_published_model,
    parse_workloads,
    run_workloads,
)
from kiln.runtime.outputs import RequestMetrics, RequestOutput
from kiln.sources.random import PRESETS

NAMES = ["128/128", "128/2048", "128/4096", "500/2000", "1000/1000", "1000/2000", "2048/128",
         "2048/2048", "5000/500"]


class FakeEngine:
    """One token per running request per step, ``max_batch`` requests at once."""

    def __init__(self, model=None, max_seq_len=8192, max_batch=4):
        self.spec = SimpleNamespace(
            model=model or SimpleNamespace(vocab_size=100),
            limits=SimpleNamespace(max_seq_len=max_seq_len, max_input_len=max_seq_len - 1),
            tp=1)
        self.tokenizer = None
        self.max_batch = max_batch
        self.reqs = {}
        self.ids = itertools.count()

    def add_request(self, prompt, params=None, request_id=None):
        rid = f"r{next(self.ids)}"
        self.reqs[rid] = (prompt, params, [])
        return rid

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        outs = []
        for rid in list(self.reqs)[: self.max_batch]:
            prompt, params, toks = self.reqs[rid]
            toks.append(1)
            fin = len(toks) >= params.max_tokens
            outs.append(RequestOutput(rid, prompt, list(toks), "", [1], "", fin,
                                      "length" if fin else None, RequestMetrics(0.0)))
            if fin:
                del self.reqs[rid]
        return outs


def test_the_published_table():
    """Names, lengths and request counts of perf-overview.md, and its Llama-3.1-8B FP8
    output tokens/s on one H100 / one H200."""
    assert list(WORKLOADS) == NAMES
    counts = {"128/128": 30000, "128/2048": 3000, "128/4096": 1500, "500/2000": 3000,
              "1000/1000": 3000, "1000/2000": 1500, "2048/128": 3000, "2048/2048": 1500,
              "5000/500": 1500}
    h100 = {"128/128": 28312, "128/2048": 22714, "128/4096": 14325, "500/2000": 17660,
            "1000/1000": 15220, "1000/2000": 13899, "2048/128": 3450, "2048/2048": 9305,
            "5000/500": 3459}
    for name, w in WORKLOADS.items():
        assert f"{w.input_len}/{w.output_len}" == name == w.name
        assert w.num_requests == counts[name]
        assert w.published("H100") == h100[name]
    assert WORKLOADS["1000/1000"].published("H200") == 17744
    assert WORKLOADS["128/128"].published("H200") == 27911


def test_parse_workloads():
    assert [w.name for w in parse_workloads(["1000/1000"])] == ["1000/1000"]
    # repeated and comma separated, in the order given, each once
    assert [w.name for w in parse_workloads(["2048/128,128/128", "2048/128"])] == [
        "2048/128", "128/128"]
    assert [w.name for w in parse_workloads(["all"])] == NAMES
    names = [w.name for w in parse_workloads(["1000/1000", "all"])]
    assert names[0] == "1000/1000" and sorted(names) == sorted(NAMES)
    with pytest.raises(ValueError) as e:
        parse_workloads(["1024/1024"])
    assert "'1024/1024'" in str(e.value) and all(n in str(e.value) for n in NAMES)
    assert "or all" in str(e.value)
    with pytest.raises(ValueError, match="names no workload"):
        parse_workloads([","])


def test_too_few_prompts_names_the_value_the_rule_and_the_fix():
    limits = Limits(max_batch_size=64, max_seq_len=4096)
    check_engine(parse_workloads(["128/128"]), 256, limits)  # 4 x 64: enough
    check_engine(parse_workloads(["128/128"]), None, limits)  # TensorRT-LLM's own count
    with pytest.raises(ValueError) as e:
        check_engine(parse_workloads(["128/128"]), 255, limits)
    msg = str(e.value)
    assert "--num-prompts 255" in msg and "max_batch_size 64" in msg
    assert "4 x" in msg and "--num-prompts 256 or more" in msg


def test_workloads_longer_than_the_engine_are_refused_before_loading():
    limits = Limits(max_batch_size=8, max_seq_len=2200)
    check_engine(parse_workloads(["128/128,128/2048,1000/1000,2048/128"]), None, limits)
    with pytest.raises(ValueError) as e:
        check_engine(parse_workloads(["all"]), None, limits)
    msg = str(e.value)
    assert msg.startswith("workloads 128/4096, 500/2000, 1000/2000, 2048/2048, 5000/500 do not")
    assert "max_seq_len 2200" in msg
    assert "--max-seq-len 5500" in msg  # the longest one: 5000 + 500
    assert msg.endswith("fit: 128/128, 128/2048, 1000/1000, 2048/128")


def test_published_card_and_model():
    assert card_of("NVIDIA H200") == "H200"
    assert card_of("NVIDIA H100 80GB HBM3") == card_of(None) == card_of("cpu") == "H100"
    assert is_published_model(FakeEngine(model=PRESETS["llama-3-8b"]))
    assert not is_published_model(FakeEngine(model=PRESETS["tiny-llama"]))
    eng = FakeEngine(model=PRESETS["llama-3-8b"])
    eng.spec.tp = 2
    assert not is_published_model(eng)


def test_run_workloads_records_every_workload_with_its_request_count():
    """The named lengths run as published; --num-prompts replaces the count; each record has
    kiln's numbers, TensorRT-LLM's and (only for Llama-3-8B's shape) the ratio."""
    eng = FakeEngine()
    labels = []

    @contextlib.contextmanager
    def progress(label, total):
        labels.append((label, total))
        yield lambda n: None

    ws = parse_workloads(["128/128", "1000/1000"])
    r = run_workloads(eng, ws, 16, seed=3, device_name="NVIDIA H200", progress=progress)
    assert r["benchmark"] == "throughput" and r["reference"]["card"] == "H200"
    assert r["config"]["num_prompts"] == 16 and r["reference"]["ratio_shown"] is False
    assert labels == [("128/128 x 16", 16 * 128), ("1000/1000 x 16", 16 * 1000)]
    assert [w["workload"] for w in r["workloads"]] == ["128/128", "1000/1000"]
    for rec, w in zip(r["workloads"], ws):
        assert rec["num_requests"] == 16 and rec["published_num_requests"] == w.num_requests
        assert rec["prompt_tokens"] == 16 * w.input_len
        assert rec["output_tokens"] == 16 * w.output_len
        assert rec["ttft_s"]["count"] == 16 and rec["tpot_s"]["count"] == 16
        assert rec["trtllm_output_tokens_per_s"] == {"H100": w.published("H100"),
                                                     "H200": w.published("H200")}
        assert rec["ratio"] is None
    big = FakeEngine(model=PRESETS["llama-3-8b"], max_batch=64)
    r = run_workloads(big, parse_workloads(["128/128"]), 64)
    rec = r["workloads"][0]
    assert r["reference"]["card"] == "H100" and r["reference"]["ratio_shown"] is True
    assert rec["ratio"] == pytest.approx(rec["output_tokens_per_s"] / 28312)


def test_render_workloads_prints_the_count_and_the_published_number():
    from rich.console import Console

    from kiln.bench.report import render_workloads

    r = run_workloads(FakeEngine(), parse_workloads(["128/128"]), 8)
    console = Console(record=True, width=100)
    render_workloads(r, console)
    text = console.export_text()
    row = next(line for line in text.splitlines() if "128/128" in line and "28,312" in line)
    assert " 8 " in row
    assert "--num-prompts in place of TensorRT-LLM's counts (128/128 30000)" in text
    assert "no ratio" in text
