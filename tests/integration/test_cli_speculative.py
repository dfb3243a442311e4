"""Speculative decoding from the command line: build-time validation (the first field
report), inspect, per-request windows in `generate`, plain vs lookahead in `bench latency`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def kiln(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    env.pop("KILN_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True,
                          text=True, env=env, timeout=600, check=False)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def la_engine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("la") / "engine"
    proc = kiln("build", "random:tiny-llama", "-o", str(out), "--dtype", "float32",
                "--speculative-decoding-mode", "lookahead", "--lookahead-config", "5,5,5",
                "--max-num-tokens", "256", "--max-batch-size", "4")
    assert proc.returncode == 0, proc.stderr
    return out


def test_max_draft_len_without_window_fails_at_build_naming_the_window(tmp_path):
    out = tmp_path / "never"
    line = one_line_error(kiln("build", "random:tiny-llama", "-o", str(out),
                               "--speculative-decoding-mode", "lookahead",
                               "--max-draft-len", "39"))
    assert "(5,5,5)" in line and "39" in line
    assert not out.exists()


def test_disagreeing_draft_len_and_window_fail_naming_both(tmp_path):
    line = one_line_error(kiln("build", "random:tiny-llama", "-o", str(tmp_path / "x"),
                               "--speculative-decoding-mode", "lookahead",
                               "--lookahead-config", "4,3,4", "--max-draft-len", "39"))
    assert "15" in line and "39" in line and "(4,3,4)" in line


def test_inspect_shows_the_recorded_window(la_engine):
    spec = json.loads(kiln("inspect", str(la_engine), "--json").stdout)["speculative"]
    assert spec["mode"] == "lookahead" and spec["lookahead"] == [5, 5, 5]
    assert spec["max_draft_len"] == 39
    table = kiln("inspect", str(la_engine)).stdout
    assert "tokens_per_step" in table and "40" in table


def test_generate_with_a_smaller_window_and_json_stats(la_engine):
    proc = kiln("generate", str(la_engine), "hello hello hello", "--raw", "--json",
                "--temperature", "0", "--max-tokens", "16", "--ignore-eos",
                "--lookahead", "3,3,2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 16
    assert out["speculative"]["mode"] == "lookahead" and out["speculative"]["spec_steps"] > 0
    plain = json.loads(kiln("generate", str(la_engine), "hello hello hello", "--raw", "--json",
                            "--temperature", "0", "--max-tokens", "16", "--ignore-eos",
                            "--lookahead", "1,1,0").stdout)
    assert plain["token_ids"] == out["token_ids"]
    assert plain["speculative"]["spec_steps"] == 0


def test_generate_window_beyond_the_engine_is_one_clear_error(la_engine):
    line = one_line_error(kiln("generate", str(la_engine), "hi", "--raw",
                               "--lookahead", "6,5,5"))
    assert "(6,5,5)" in line and "(5,5,5)" in line


def test_bench_latency_compares_plain_and_lookahead(la_engine, tmp_path):
    out = tmp_path / "lat.json"
    proc = kiln("bench", "latency", str(la_engine), "--num-iters", "1", "--warmup", "0",
                "--input-len", "8", "--output-len", "8", "--spec-prompts", "1",
                "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Plain vs lookahead" in proc.stdout
    spec = json.loads(out.read_text())["speculative"]
    assert spec["config"]["repeats"] == 3  # the default: alternated runs, medians
    assert "range" in proc.stdout
    for name in ("code", "chat"):
        s = spec["sets"][name]
        assert s["same_output"] and s["speedup"] > 0 and s["tokens_per_step"] >= 1
        assert len(s["speedups"]) == 3 and all(u > 0 for u in s["speedups"])
        assert len(s["requests"][0]["elapsed_s_per_repeat"]) == 3


def test_the_lookahead_engine_serves_with_per_request_windows(la_engine):
    """The field report's case end to end: --lookahead-config 5,5,5 builds and serves; a
    request may shrink the window; one beyond it is a 400 naming both, and the server
    keeps serving."""
    import httpx

    from kiln.server.testing import ServerProcess

    with ServerProcess(la_engine) as server:
        base = {"model": httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"],
                "prompt": "hello hello hello", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        plain = httpx.post(f"{server.url}/v1/completions",
                           json={**base, "lookahead": {"w": 1, "n": 1, "g": 0}}, timeout=60)
        small = httpx.post(f"{server.url}/v1/completions",
                           json={**base, "lookahead": {"w": 3, "n": 3, "g": 2}}, timeout=60)
        default = httpx.post(f"{server.url}/v1/completions", json=base, timeout=60)
        assert plain.status_code == small.status_code == default.status_code == 200
        texts = {r.json()["choices"][0]["text"] for r in (plain, small, default)}
        assert len(texts) == 1  # greedy speculation never changes the output
        bad = httpx.post(f"{server.url}/v1/completions",
                         json={**base, "lookahead": {"w": 6, "n": 5, "g": 5}}, timeout=60)
        assert bad.status_code == 400
        err = bad.json()["error"]
        assert err["param"] == "lookahead" and "(6,5,5)" in err["message"]
        assert "(5,5,5)" in err["message"]
        assert httpx.get(f"{server.url}/health").status_code == 200
