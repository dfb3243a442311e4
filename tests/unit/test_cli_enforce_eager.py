"""--enforce-eager, --no-async-scheduling and --adaptive-speculation/--always-speculate (serve,
generate, bench throughput/latency): no CUDA graphs / no step launched ahead / paced or
unpaced speculation, same results."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kiln.cli.app import app
from kiln.cli.generate import runtime_config


@pytest.mark.parametrize("flag, field, default, env", [
    ("enforce_eager", "cuda_graphs", True, ("KILN_CUDA_GRAPHS", "0")),
    ("no_async", "async_scheduling", True, ("KILN_ASYNC_SCHEDULING", "0")),
])
def test_runtime_config_changes_a_setting_only_when_asked(monkeypatch, flag, field, default,
                                                          env):
    """Each flag flips its RuntimeConfig field; without it the default holds, and the
    environment variable still works without the flag."""
    monkeypatch.delenv(env[0], raising=False)
    assert getattr(runtime_config(None), field) is default
    assert getattr(runtime_config("cpu", **{flag: True}), field) is (not default)
    monkeypatch.setenv(*env)
    assert getattr(runtime_config(None), field) is (not default)


def test_adaptive_speculation_is_the_default_and_can_be_turned_off(monkeypatch):
    """--adaptive-speculation is the default; --always-speculate (adaptive_spec=False) or
    KILN_ADAPTIVE_SPECULATION=0 turn it off; the explicit flag beats the environment."""
    monkeypatch.delenv("KILN_ADAPTIVE_SPECULATION", raising=False)
    assert runtime_config(None).adaptive_speculation is True
    assert runtime_config("cpu", adaptive_spec=False).adaptive_speculation is False
    monkeypatch.setenv("KILN_ADAPTIVE_SPECULATION", "0")
    assert runtime_config(None).adaptive_speculation is False
    assert runtime_config(None, adaptive_spec=True).adaptive_speculation is True


@pytest.mark.parametrize("cmd", [["serve"], ["generate"], ["bench", "throughput"],
                                 ["bench", "latency"]])
def test_flag_is_documented(cmd):
    res = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--enforce-eager" in res.output
    assert "--no-async-scheduling" in res.output and "--adaptive-speculation" in res.output
    assert "--always-speculate" in res.output


def test_generate_with_enforce_eager(tmp_path):
    from kiln.builder import build_engine

    out = tmp_path / "tiny"
    build_engine("random:tiny-llama", out, dtype="float32", progress=False)
    args = ["generate", str(out), "hello", "--max-tokens", "4", "--temperature", "0",
            "--raw", "--json", "--device", "cpu"]
    plain = CliRunner().invoke(app, args)
    eager = CliRunner().invoke(app, [*args, "--enforce-eager"])
    assert plain.exit_code == 0 and eager.exit_code == 0, (plain.output, eager.output)
    assert (json.loads(eager.stdout.strip().splitlines()[-1])["token_ids"]
            == json.loads(plain.stdout.strip().splitlines()[-1])["token_ids"])


def test_bench_latency_records_how_the_engine_ran(tmp_path):
    from kiln.builder import build_engine

    out = tmp_path / "tiny"
    build_engine("random:tiny-llama", out, dtype="float32", progress=False)
    runs = {}
    for flag in ([], ["--no-async-scheduling"]):
        res = CliRunner().invoke(app, ["bench", "latency", str(out), "--device", "cpu",
                                       "--batch-size", "1", "--input-len", "8",
                                       "--output-len", "4", "--num-iters", "1",
                                       "--json", str(tmp_path / "r.json"), *flag])
        assert res.exit_code == 0, res.output
        env = json.loads((tmp_path / "r.json").read_text())["environment"]
        runs[bool(flag)] = env
    assert runs[False]["async_scheduling"] is True and runs[True]["async_scheduling"] is False
    assert runs[False]["attention_backend"] == "torch" and runs[False]["cuda_graphs"] is False
    assert runs[False]["spec_break_even"] is None  # not speculative
    assert runs[False]["device_speculation"] is False
    assert runs[False]["pdl"] is None  # recorded on CUDA only (KILN_PDL's mode)
    assert runs[False]["sampling_kernels"] is False  # CPU: torch's argmax / softmax
