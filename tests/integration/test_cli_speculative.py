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


def test_a_lookahead_build_without_a_window_takes_the_default_and_says_so(tmp_path):
    out = tmp_path / "la"
    proc = kiln("build", "random:tiny-llama", "-o", str(out), "--dtype", "float32",
                "--speculative-decoding-mode", "lookahead", "--max-batch-size", "2")
    assert proc.returncode == 0, proc.stderr
    assert "lookahead window 7,7,7 (the default" in proc.stderr
    spec = json.loads((out / "engine.json").read_text())["speculative"]
    assert spec["lookahead"] == [7, 7, 7] and spec["max_draft_len"] == 83


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


# ---- draft-model engines (build side; serving them is the runtime's tests) ---------------

DRAFT_BUILD = ("--dtype", "float32", "--speculative-decoding-mode", "draft", "--max-seq-len",
               "128", "--no-tune", "--no-precompile-kernels")


@pytest.fixture(scope="module")
def draft_engine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft") / "engine"
    proc = kiln("build", "random:tiny-llama", "-o", str(out), *DRAFT_BUILD,
                "--draft-model", "random:tiny-qwen2", "--max-draft-len", "4")
    assert proc.returncode == 0, proc.stderr
    assert "building the draft model random:tiny-qwen2" in " ".join(proc.stderr.split())
    return out


def test_draft_build_records_the_draft_engine(draft_engine):
    assert (draft_engine / "draft" / "engine.json").is_file()
    assert (draft_engine / "draft" / "tokenizer").is_dir()
    spec = json.loads((draft_engine / "engine.json").read_text())["speculative"]
    assert spec["mode"] == "draft" and spec["max_draft_len"] == 4
    assert spec["draft_model"] == "random:tiny-qwen2" and spec["draft_engine"] == "draft"
    assert len(spec["draft_sha256"]) == 64


def test_inspect_shows_the_draft_engine(draft_engine):
    proc = kiln("inspect", str(draft_engine))
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout
    assert "Draft engine" in table
    for needle in ("qwen2", "k (max_draft_len)", "vocab size", "107,072", "random (seed 0)",
                   "engine.json sha256"):
        assert needle in table, needle
    out = json.loads(kiln("inspect", str(draft_engine), "--json").stdout)
    assert out["speculative"]["mode"] == "draft"
    assert out["draft"]["model"]["architecture"] == "qwen2"
    assert out["draft"]["speculative"]["mode"] == "none"
    assert out["draft"]["limits"] == out["limits"] and out["draft"]["dtype"] == "float32"


def test_inspect_json_of_other_engines_has_no_draft(la_engine):
    out = json.loads(kiln("inspect", str(la_engine), "--json").stdout)
    assert "draft" not in out and "draft_model" not in out["speculative"]


def test_draft_of_another_tokenizer_is_one_clear_error_writing_nothing(tmp_path):
    import transformers

    from kiln.sources import make_byte_tokenizer

    src = tmp_path / "other-tok"
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=512, bos_token_id=256, eos_token_id=257)
    transformers.LlamaForCausalLM(cfg).save_pretrained(src)
    tok = make_byte_tokenizer()
    tok.add_tokens(["<|fim_middle|>"])
    tok.save_pretrained(src)
    parent = tmp_path / "out"
    parent.mkdir()
    line = one_line_error(kiln("build", "random:tiny-llama", "-o", str(parent / "e"),
                               *DRAFT_BUILD, "--draft-model", str(src),
                               "--max-draft-len", "4"))
    assert "does not share the tokenizer of target random:tiny-llama" in line
    assert "260 tokens vs draft 261" in line and "qwen2.5-coder-0.5b" in line
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize("args,needles", [
    (("--draft-model", "random:tiny-qwen2", "--max-draft-len", "17"),
     ["--max-draft-len 17", "1 <= max_draft_len <= 16", "--max-draft-len 4"]),
    (("--max-draft-len", "4"), ["needs --draft-model SOURCE"]),
    (("--draft-model", "random:tiny-qwen2"), ["needs --max-draft-len K"]),
])
def test_draft_flag_errors_are_one_line(tmp_path, args, needles):
    line = one_line_error(kiln("build", "random:tiny-llama", "-o", str(tmp_path / "e"),
                               *DRAFT_BUILD, *args))
    for needle in needles:
        assert needle in line, (needle, line)
    assert list(tmp_path.iterdir()) == []


def test_draft_model_without_mode_draft_is_one_line(tmp_path):
    line = one_line_error(kiln("build", "random:tiny-llama", "-o", str(tmp_path / "e"),
                               "--draft-model", "random:tiny-qwen2"))
    assert "--draft-model random:tiny-qwen2 given" in line and "mode is 'none'" in line
    line = one_line_error(kiln("build", "random:tiny-llama", "-o", str(tmp_path / "e"),
                               "--speculative-decoding-mode", "ngram", "--max-draft-len", "4",
                               "--draft-model", "random:tiny-qwen2"))
    assert "applies to mode 'draft', not 'ngram'" in line
    assert list(tmp_path.iterdir()) == []


def test_build_help_documents_the_draft_model():
    out = " ".join(kiln("build", "--help").stdout.split())
    assert "--draft-model SOURCE" in out and "ENGINE/draft" in out
    assert "draft (a draft model, --draft-model)" in out


def test_suffix_build_records_its_settings_and_inspect_shows_them(tmp_path):
    out = tmp_path / "suffix"
    proc = kiln("build", "random:tiny-llama", "-o", str(out), "--dtype", "float32",
                "--speculative-decoding-mode", "suffix", "--suffix-tree-depth", "12",
                "--suffix-cache-requests", "64", "--max-draft-len", "6",
                "--max-num-tokens", "256", "--max-batch-size", "4", "--no-precompile-kernels")
    assert proc.returncode == 0, proc.stderr
    spec = json.loads((out / "engine.json").read_text())["speculative"]
    assert {k: spec[k] for k in ("mode", "max_draft_len", "suffix_tree_depth",
                                 "suffix_min_match", "suffix_cache_requests")} == {
        "mode": "suffix", "max_draft_len": 6, "suffix_tree_depth": 12,
        "suffix_min_match": 2, "suffix_cache_requests": 64}
    shown = kiln("inspect", str(out))
    assert shown.returncode == 0, shown.stderr
    for needle in ("suffix_tree_depth", "suffix_cache_requests", "64"):
        assert needle in shown.stdout, needle
    gen = kiln("generate", str(out), "hello hello hello", "--max-tokens", "8",
               "--temperature", "0")
    assert gen.returncode == 0, gen.stderr
    assert "shared cache of up to 64 responses" in gen.stderr


@pytest.mark.parametrize("args,needles", [
    (("--max-draft-len", "30"), ["--max-draft-len 30", "1 <= max_draft_len <= 22",
                                 "--max-draft-len 22"]),
    (("--suffix-tree-depth", "1"), ["--suffix-tree-depth 1 is invalid", "2 to 64"]),
    (("--lookahead-config", "5,5,5"), ["--lookahead-config 5,5,5 does not apply to mode "
                                       "'suffix'"]),
])
def test_suffix_flag_errors_are_one_line(tmp_path, args, needles):
    out = tmp_path / "never"
    line = one_line_error(kiln("build", "random:tiny-llama", "-o", str(out),
                               "--speculative-decoding-mode", "suffix", *args))
    for needle in needles:
        assert needle in line, line
    assert not out.exists()


def _spec_counters(client) -> tuple[float, float]:
    text = client.get("/metrics").text
    got = {}
    for line in text.splitlines():
        for name in ("kiln_spec_decode_steps_total", "kiln_spec_decode_tokens_total"):
            if line.startswith(name + " ") or line.startswith(name + "{"):
                got[name] = float(line.rsplit(" ", 1)[1])
    return got["kiln_spec_decode_steps_total"], got["kiln_spec_decode_tokens_total"]


@pytest.mark.parametrize("how", ["header", "user"])
def test_serve_keeps_one_suffix_cache_per_tenant(tmp_path, how):
    """kiln serve --suffix-cache-scope tenant over real HTTP: a tenant named by the header
    (or the body's user field) drafts from its own earlier answers, and another tenant's
    request for the same text commits exactly what the first, cache-less one did."""
    import httpx

    from kiln.server.testing import ServerProcess

    out = tmp_path / "suffix"
    proc = kiln("build", "random:tiny-llama", "-o", str(out), "--dtype", "float32",
                "--speculative-decoding-mode", "suffix", "--max-draft-len", "8",
                "--max-num-tokens", "256", "--max-batch-size", "4", "--no-precompile-kernels")
    assert proc.returncode == 0, proc.stderr
    args = ["--suffix-cache-scope", "tenant", "--device", "cpu"]
    args += ["--tenant-header", "X-Tenant"] if how == "header" else []
    with ServerProcess(out, *args) as server, httpx.Client(base_url=server.url,
                                                           timeout=120) as client:
        assert any("one cache of earlier responses per tenant" in ln for ln in server.log)

        def per_step(tenant: str) -> float:
            body = {"model": "suffix", "prompt": "the cat sat on the mat " * 3,
                    "max_tokens": 48, "temperature": 0, "ignore_eos": True}
            headers = {}
            if how == "header":
                headers["X-Tenant"] = tenant
                body["user"] = "same-user-for-all"  # ignored: the header names the tenant
            else:
                body["user"] = tenant
            steps0, tokens0 = _spec_counters(client)
            r = client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            steps, tokens = _spec_counters(client)
            return (tokens - tokens0) / max(steps - steps0, 1)

        first = per_step("alice")
        assert per_step("bob") == first
        assert per_step("alice") > first


def test_serve_refuses_a_tenant_cache_scope_on_an_engine_without_one(tmp_path):
    out = tmp_path / "plain"
    proc = kiln("build", "random:tiny-llama", "-o", str(out), "--dtype", "float32",
                "--max-num-tokens", "256", "--max-batch-size", "4", "--no-precompile-kernels")
    assert proc.returncode == 0, proc.stderr
    line = one_line_error(kiln("serve", str(out), "--suffix-cache-scope", "tenant",
                               "--port", "0", "--device", "cpu"))
    assert "--suffix-cache-scope tenant" in line and "'none'" in line, line
    assert "--speculative-decoding-mode suffix" in line, line
    line = one_line_error(kiln("serve", str(out), "--tenant-header", "X-Tenant", "--port", "0"))
    assert "--tenant-header X-Tenant needs --suffix-cache-scope tenant" in line, line
    line = one_line_error(kiln("serve", str(out), "--suffix-cache-scope", "user",
                               "--port", "0"))
    assert "'user' is not one of server, tenant" in line, line
