"""`kiln generate` and `kiln bench` as a user runs them: real subprocesses, a tiny engine.

The engine is built once per module from the seeded random preset ``random:tiny-llama``
(float32, CPU). Benchmarks only check that results have the expected shape: a timed number
never makes a test pass or fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def kiln(*args: str, stdin: str | None = None, env: dict | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONIOENCODING": "utf-8", "NO_COLOR": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")]))}
    full_env.pop("KILN_DEBUG", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args], input=stdin, capture_output=True, text=True,
        encoding="utf-8", errors="replace", env=full_env, timeout=timeout, check=False,
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\n" \
                                 f"stderr:\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("engines") / "tiny"
    ok(kiln("build", "random:tiny-llama", "-o", str(out), "--dtype", "float32"))
    assert (out / "engine.json").is_file()
    return str(out)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], proc.stderr


# --- the app itself -------------------------------------------------------------------------


def test_help_lists_commands():
    proc = ok(kiln("--help"))
    for cmd in ("build", "inspect", "generate", "bench"):
        assert cmd in proc.stdout
    bench = ok(kiln("bench", "--help"))
    assert "throughput" in bench.stdout and "latency" in bench.stdout


def test_version():
    from kiln import __version__

    assert ok(kiln("--version")).stdout.strip() == f"kiln {__version__}"


def test_help_does_not_import_torch():
    code = ("import sys; from kiln.cli.app import app; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]


# --- error paths -----------------------------------------------------------------------------


def test_missing_engine_is_one_line_error(tmp_path):
    proc = kiln("generate", str(tmp_path / "nope"), "hi")
    assert_one_line_error(proc, "does not exist", "kiln build")
    proc = kiln("bench", "throughput", str(tmp_path / "nope"), "--num-prompts", "1")
    assert_one_line_error(proc, "does not exist")


def test_not_an_engine_dir(tmp_path):
    assert_one_line_error(kiln("generate", str(tmp_path), "hi"), "engine.json")


def test_debug_shows_traceback(tmp_path):
    proc = kiln("--debug", "generate", str(tmp_path / "nope"), "hi")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "error: " in proc.stderr
    proc = kiln("generate", str(tmp_path / "nope"), "hi", env={"KILN_DEBUG": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr


def test_bad_sampling_value_is_clear_error(engine_dir):
    assert_one_line_error(kiln("generate", engine_dir, "hi", "--temperature", "-1"),
                          "temperature")
    assert_one_line_error(kiln("generate", engine_dir, "hi", "--top-p", "0"), "top_p")
    assert_one_line_error(kiln("generate", engine_dir, "hi", "--max-tokens", "0"),
                          "max_tokens")


def test_bad_flag_type_is_usage_error(engine_dir):
    proc = kiln("generate", engine_dir, "hi", "--max-tokens", "lots")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "--max-tokens" in proc.stderr


def test_bench_lengths_beyond_limits(engine_dir):
    proc = kiln("bench", "latency", engine_dir, "--input-len", "100000", "--output-len", "4",
                "--device", "cpu")
    assert_one_line_error(proc, "max_")


# --- generate --------------------------------------------------------------------------------


def generate_json(engine_dir: str, *args: str, stdin: str | None = None) -> dict:
    proc = ok(kiln("generate", engine_dir, *args, "--json", "--device", "cpu", stdin=stdin))
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stdout  # exactly one JSON object, nothing else on stdout
    return json.loads(lines[0])


def test_generate_json_ignore_eos(engine_dir):
    out = generate_json(engine_dir, "Hello kiln", "--max-tokens", "9", "--ignore-eos",
                        "--temperature", "0")
    assert set(out) >= {"text", "token_ids", "prompt_tokens", "finish_reason", "timings"}
    assert len(out["token_ids"]) == 9
    assert out["finish_reason"] == "length"
    assert out["prompt_tokens"] > 0
    assert set(out["timings"]) >= {"ttft_s", "total_s", "tokens_per_s", "load_s"}
    assert out["timings"]["ttft_s"] <= out["timings"]["total_s"]


def test_generate_chat_template_vs_raw_prompt_tokens(engine_dir):
    chat = generate_json(engine_dir, "Hello", "--max-tokens", "2", "--ignore-eos")
    raw = generate_json(engine_dir, "Hello", "--max-tokens", "2", "--ignore-eos", "--raw")
    # the chat template wraps the prompt, so it has more tokens than the plain text
    assert chat["prompt_tokens"] > raw["prompt_tokens"]


def test_generate_greedy_is_deterministic_and_seeded_sampling_repeats(engine_dir):
    args = ("Once upon a time", "--max-tokens", "12", "--ignore-eos", "--raw")
    a = generate_json(engine_dir, *args, "--temperature", "0")
    b = generate_json(engine_dir, *args, "--temperature", "0")
    assert a["token_ids"] == b["token_ids"]
    c = generate_json(engine_dir, *args, "--temperature", "1", "--seed", "7")
    d = generate_json(engine_dir, *args, "--temperature", "1", "--seed", "7")
    assert c["token_ids"] == d["token_ids"]


def test_generate_raw_streams_the_same_text(engine_dir):
    args = ("The kiln", "--max-tokens", "16", "--ignore-eos", "--temperature", "0", "--raw")
    proc = ok(kiln("generate", engine_dir, *args, "--device", "cpu"))
    assert proc.stdout.endswith("\n")
    assert "16 tokens" in proc.stderr and "tokens/s" in proc.stderr
    expected = generate_json(engine_dir, *args)["text"]
    streamed = proc.stdout[:-1] if not expected.endswith("\n") else proc.stdout
    assert streamed == expected


def test_generate_prompt_from_stdin(engine_dir):
    a = generate_json(engine_dir, "-", "--raw", "--max-tokens", "3", "--ignore-eos",
                      "--temperature", "0", stdin="from stdin\n")
    b = generate_json(engine_dir, "from stdin", "--raw", "--max-tokens", "3", "--ignore-eos",
                      "--temperature", "0")
    assert a["token_ids"] == b["token_ids"]
    assert a["prompt_tokens"] == b["prompt_tokens"]


# --- bench -----------------------------------------------------------------------------------

SUMMARY_KEYS = {"mean", "median", "p90", "p99"}
ENV_KEYS = {"command", "engine_dir", "device_name", "torch_version", "date"}


def test_bench_throughput_json(engine_dir, tmp_path):
    path = tmp_path / "tp.json"
    proc = ok(kiln("bench", "throughput", engine_dir, "--num-prompts", "6", "--input-len", "8",
                   "--output-len", "5", "--seed", "1", "--json", str(path), "--device", "cpu"))
    assert "tokens/s" in proc.stdout
    r = json.loads(path.read_text())
    assert r["benchmark"] == "throughput"
    assert r["num_requests"] == 6
    # where the time went: the engine's steps and the mean step, printed and recorded
    assert r["num_steps"] >= 5 and "engine steps" in proc.stdout
    assert f"{1000 * r['elapsed_s'] / r['num_steps']:.2f}" in proc.stdout
    assert r["num_preemptions"] == 0 and "preemptions" in proc.stdout
    assert r["output_tokens"] == 30 and r["prompt_tokens"] == 48
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "elapsed_s"):
        assert r[key] > 0
    assert set(r["environment"]) >= ENV_KEYS
    assert "bench throughput" in r["environment"]["command"]


def test_bench_throughput_dataset(engine_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"prompt number {i} about kilns",
                                          "output_len": 4 + i}) for i in range(3)) + "\n")
    path = tmp_path / "tp.json"
    ok(kiln("bench", "throughput", engine_dir, "--dataset", str(data), "--num-prompts", "3",
            "--json", str(path), "--device", "cpu"))
    r = json.loads(path.read_text())
    assert r["num_requests"] == 3 and r["output_tokens"] == 4 + 5 + 6


def test_bench_latency_json(engine_dir, tmp_path):
    path = tmp_path / "lat.json"
    ok(kiln("bench", "latency", engine_dir, "--batch-size", "2", "--input-len", "8",
            "--output-len", "4", "--num-iters", "2", "--warmup", "1", "--json", str(path),
            "--device", "cpu"))
    r = json.loads(path.read_text())
    assert r["benchmark"] == "latency"
    for key in ("latency_s", "ttft_s", "tpot_s", "e2e_s"):
        assert set(r[key]) >= SUMMARY_KEYS
    assert r["latency_s"]["count"] == 2
    assert r["ttft_s"]["count"] == 4
    assert len(r["iterations"]) == 2
    assert set(r["environment"]) >= ENV_KEYS
    assert r["tp"] == 1 and len(r["memory_by_rank"]) == 1  # rank 0 alone
    assert r["memory_by_rank"][0]["peak_rss_bytes"] > 50 * 2**20  # torch alone is more


# --- bench serve (against a minimal OpenAI-style streaming server on loopback) ---------------


@pytest.fixture
def fake_server():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(req["max_tokens"]):
                chunk = {"choices": [{"index": 0, "text": f"w{i}"}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_bench_serve_json(engine_dir, fake_server, tmp_path):
    path = tmp_path / "serve.json"
    ok(kiln("bench", "serve", "--base-url", fake_server, "--model", "tiny",
            "--tokenizer", engine_dir, "--num-prompts", "4", "--input-len", "8",
            "--output-len", "3", "--max-concurrency", "2", "--json", str(path)))
    r = json.loads(path.read_text())
    assert r["benchmark"] == "serve"
    assert r["completed"] == 4 and r["failed"] == 0 and r["output_tokens"] == 12
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(r[key]) >= SUMMARY_KEYS


def test_bench_serve_unreachable_is_one_line_error(engine_dir):
    proc = kiln("bench", "serve", "--base-url", "http://127.0.0.1:9", "--tokenizer",
                engine_dir, "--num-prompts", "1")
    assert_one_line_error(proc, "is the server running")
