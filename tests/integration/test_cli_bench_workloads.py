"""`kiln bench throughput` with a prompt file (every record runs) and with TensorRT-LLM's
workloads by name, as a user runs them: a tiny float32 engine of max_batch_size 2 on the CPU.

The named workloads' real lengths run (128/128 fits the tiny engine's 512 positions); the
request count is scaled down with --num-prompts. A timed number never makes a test fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BATCH = 2  # the engine's max_batch_size: --num-prompts must be at least 4 x 2 = 8


def kiln(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    # one thread: the tiny model gains nothing from more, and on a busy machine they spin
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "NO_COLOR": "1", "COLUMNS": "120",
           "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                       os.environ.get("PYTHONPATH")]))}
    env.pop("KILN_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True,
                          encoding="utf-8", errors="replace", env=env, timeout=timeout,
                          check=False)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\n" \
                                 f"stderr:\n{proc.stderr}"
    return proc


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("engines") / "tiny"
    ok(kiln("build", "random:tiny-llama", "-o", str(out), "--dtype", "float32",
            "--max-batch-size", str(BATCH)))
    return str(out)


def test_dataset_runs_every_record(engine_dir, tmp_path):
    """5 records (no default's count) and no --num-prompts: all 5 run, and the table and
    the JSON say so."""
    data = tmp_path / "five.jsonl"
    data.write_text("\n".join([
        json.dumps({"prompt": f"record number {i} about a kiln firing", "output_len": 4 + i})
        for i in range(4)] + [json.dumps({"conversations": [
            {"from": "human", "value": "what goes into a glaze recipe"},
            {"from": "gpt", "value": "silica alumina flux"}]})]) + "\n")
    path = tmp_path / "tp.json"
    proc = ok(kiln("bench", "throughput", engine_dir, "--dataset", str(data), "--json",
                   str(path), "--device", "cpu"))
    assert "5 (of 5 records)" in proc.stdout
    r = json.loads(path.read_text())
    assert r["num_requests"] == 5 and r["config"]["num_prompts"] == 5
    assert r["config"]["dataset_records"] == 5 and r["config"]["dataset_skipped"] == 0
    proc = ok(kiln("bench", "throughput", engine_dir, "--dataset", str(data), "--num-prompts",
                   "3", "--json", str(path), "--device", "cpu"))
    assert "3 (of 5 records)" in proc.stdout and json.loads(path.read_text())["num_requests"] == 3


def test_workload_runs_its_lengths_and_prints_the_count(engine_dir, tmp_path):
    path = tmp_path / "w.json"
    proc = ok(kiln("bench", "throughput", engine_dir, "--workload", "128/128", "--num-prompts",
                   str(4 * BATCH), "--json", str(path), "--device", "cpu"))
    row = next(ln for ln in proc.stdout.splitlines() if "128/128" in ln and "28,312" in ln)
    assert f" {4 * BATCH} " in row  # the request count beside the result
    assert "(128/128 30000)" in proc.stdout  # the published count it replaced
    r = json.loads(path.read_text())
    [w] = r["workloads"]
    assert (w["workload"], w["input_len"], w["output_len"]) == ("128/128", 128, 128)
    assert w["num_requests"] == 8 and w["published_num_requests"] == 30000
    assert w["prompt_tokens"] == w["output_tokens"] == 8 * 128
    assert w["output_tokens_per_s"] > 0 and w["ttft_s"]["count"] == w["tpot_s"]["count"] == 8
    assert w["trtllm_output_tokens_per_s"]["H100"] == 28312 and w["ratio"] is None
    assert r["reference"]["card"] == "H100" and "bench throughput" in r["environment"]["command"]


@pytest.mark.parametrize("args, needles", [
    (["--workload", "100/100"], ["'100/100'", "128/128, 128/2048", "5000/500, or all"]),
    (["--workload", "128/128", "--num-prompts", "7"],
     ["--num-prompts 7", f"max_batch_size {BATCH}", "4 x", "--num-prompts 8 or more"]),
    (["--workload", "all"], ["do not fit", "max_seq_len 512", "--max-seq-len 5500",
                             "fit: 128/128"]),
    (["--workload", "128/128", "--input-len", "16"], ["--input-len cannot go with it"]),
])
def test_workload_errors_are_one_line(engine_dir, args, needles):
    line = one_line_error(kiln("bench", "throughput", engine_dir, *args, "--device", "cpu"))
    for needle in needles:
        assert needle in line, line


def test_every_workload_is_in_the_json(engine_dir, tmp_path, monkeypatch):
    """`--workload all` runs each workload of the table (here the real 128/128 and a short
    one put in its place, in process) and writes one record per workload."""
    import torch
    from typer.testing import CliRunner

    from kiln.bench import workloads
    from kiln.cli.app import app

    table = {"128/128": workloads.WORKLOADS["128/128"],
             "16/8": workloads.Workload(16, 8, 100, 1000.0, 1100.0)}
    monkeypatch.setattr(workloads, "WORKLOADS", table)
    path = tmp_path / "all.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = CliRunner().invoke(
            app, ["bench", "throughput", engine_dir, "--workload", "all", "--num-prompts", "8",
                  "--json", str(path), "--device", "cpu"], env={"COLUMNS": "120", "NO_COLOR": "1"})
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    r = json.loads(path.read_text())
    assert [w["workload"] for w in r["workloads"]] == ["128/128", "16/8"]
    assert [w["output_tokens"] for w in r["workloads"]] == [8 * 128, 8 * 8]
    assert all(w["num_requests"] == 8 for w in r["workloads"])
    assert "(128/128 30000, 16/8 100)" in res.output


def test_help_explains_workloads_and_counts():
    from typer.testing import CliRunner

    from kiln.cli.app import app

    res = CliRunner().invoke(app, ["bench", "throughput", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    text = " ".join(res.output.replace("│", " ").split())
    for needle in ("--workload", "1000/1000", "5000/500", "'all'", "every record of the file",
                   "at least 4x the engine's max_batch_size", "Llama-3.1-8B FP8 on one H100",
                   "Llama-3-8B's shape"):
        assert needle in text, needle
