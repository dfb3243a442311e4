"""kiln.bench.online against a small fake OpenAI-compatible SSE server on loopback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from kiln.bench.online import ServePrompt, run_serve, synthetic_prompts


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[dict]] = []

    def log_message(self, *args):  # keep test output clean
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "fake-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(req)
        if req.get("max_tokens") == 99:
            body = json.dumps({"error": {"message": "too long", "type": "invalid_request_error",
                                         "param": None, "code": None}}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        chat = "messages" in req
        n = req["max_tokens"]
        for i in range(n):
            choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else \
                {"index": 0, "text": f"t{i} "}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


@pytest.fixture
def server():
    _Handler.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_run_serve_completions(server):
    prompts = [ServePrompt(f"prompt {i}", 5) for i in range(6)]
    ticks = []
    r = run_serve(server, prompts, max_concurrency=2, progress=ticks.append)
    assert r["config"]["model"] == "fake-model"  # from /v1/models
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["output_tokens"] == 30 and r["prompt_tokens"] == 42
    assert r["ttft_s"]["count"] == 6 and r["tpot_s"]["count"] == 6
    assert r["itl_s"]["count"] == 6 * 4  # 5 chunks -> 4 gaps each
    assert r["tokens_per_chunk"] == pytest.approx(1.0)
    assert sum(ticks) == 6
    sent = _Handler.seen[0]
    assert sent["stream"] is True and sent["ignore_eos"] is True and sent["max_tokens"] == 5
    assert sent["prompt"].startswith("prompt")


def test_run_serve_chat_and_poisson_arrivals(server):
    prompts = [ServePrompt("hi", 3) for _ in range(4)]
    r = run_serve(server, prompts, model="m", endpoint="/v1/chat/completions",
                  request_rate=1000.0, seed=3)
    assert r["completed"] == 4 and r["output_tokens"] == 12
    assert _Handler.seen[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert _Handler.seen[0]["model"] == "m"


def test_failures_are_counted_not_raised(server):
    r = run_serve(server, [ServePrompt("x", 99), ServePrompt("y", 2)], model="m")
    assert r["completed"] == 1 and r["failed"] == 1
    assert r["errors"] == ["HTTP 400: too long"]


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(ValueError, match="is the server running"):
        run_serve("http://127.0.0.1:9", [ServePrompt("x", 2)])


def test_bad_arguments():
    with pytest.raises(ValueError, match="request_rate"):
        run_serve("http://x", [ServePrompt("x", 2)], model="m", request_rate=0)
    with pytest.raises(ValueError, match="no prompts"):
        run_serve("http://x", [], model="m")


def test_synthetic_prompts():
    class Tok:
        all_special_ids: ClassVar[list[int]] = [0]

        def __len__(self):
            return 10

        def decode(self, ids):
            assert 0 not in ids
            return " ".join(map(str, ids))

    ps = synthetic_prompts(Tok(), 3, 5, 4, seed=1)
    assert len(ps) == 3 and all(p.output_len == 4 and p.prompt_len == 5 for p in ps)
    assert ps == synthetic_prompts(Tok(), 3, 5, 4, seed=1)
