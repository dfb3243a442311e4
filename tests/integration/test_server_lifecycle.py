"""`kiln serve`'s service lifecycle: SIGTERM/SIGINT drain, a busy port, slow clients, and the
queue limit, against real server subprocesses over a tiny random float32 engine."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kiln.server.testing import ServerProcess


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    from kiln.builder import build_engine

    out = tmp_path_factory.mktemp("lifecycle") / "tiny"
    build_engine("random:tiny-llama", out, dtype="float32", max_seq_len=512,
                 max_batch_size=16, progress=False)
    return out


class Stream:
    """One streamed completion read on a thread: each SSE payload with its arrival time."""

    def __init__(self, url: str, body: dict):
        self.events: list[tuple[float, str]] = []
        self.status: int | None = None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            self.status = r.status_code
            buf = b""
            for part in r.iter_bytes():  # events end in a blank line; split only there (the
                buf += part               # text may hold U+2028, which str.splitlines splits)
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    assert event.startswith(b"data: "), event
                    self.events.append((time.monotonic(), event[6:].decode()))
                    self.first.set()
        self.first.set()

    def chunks(self) -> list[dict]:
        return [json.loads(d) for _, d in self.events if d != "[DONE]"]

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1][1] == "[DONE]"


def _error(body: dict, code: str | None = None) -> dict:
    assert set(body) >= {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def test_sigterm_drains_in_flight_requests_then_ends_the_rest(engine_dir):
    # Batch of 16: the short request takes one slot, the long one 15 (and 75 more wait behind
    # them), so the short one finishes in 2-3 s (more on a loaded machine, hence a 10 s drain:
    # 6 s was once too short) and the long one would take ~40 s (on the CPU everywhere: a GPU
    # would finish both before the signal; 45 choices once all finished within 9 s).
    with ServerProcess(engine_dir, "--shutdown-timeout", "10", "--device", "cpu") as s:
        short = Stream(s.url, {"prompt": "a", "max_tokens": 200, "ignore_eos": True,
                               "stream_options": {"include_usage": True}})
        assert short.first.wait(30)
        long = Stream(s.url, {"prompt": ["b", "c", "d", "f", "g", "h"], "n": 15,
                              "max_tokens": 480, "ignore_eos": True})
        assert long.first.wait(30)
        plain: list[httpx.Response] = []  # not streamed: waits behind the long one's choices
        plain_thread = threading.Thread(target=lambda: plain.append(httpx.post(
            s.url + "/v1/completions", timeout=60,
            json={"prompt": "e", "max_tokens": 480, "ignore_eos": True})))
        plain_thread.start()
        time.sleep(0.2)
        t_sig = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3
        while httpx.get(s.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health did not turn 503 on SIGTERM"
            time.sleep(0.05)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        _error(r.json(), "shutting_down")

        short.thread.join(30)
        assert short.status == 200 and short.done, short.events[-3:]
        assert short.events[-1][0] > t_sig, "the short request was not in flight at SIGTERM"
        assert short.chunks()[-2]["choices"][0]["finish_reason"] == "length"
        assert short.chunks()[-1]["usage"]["completion_tokens"] == 200

        rc = s.proc.wait(15)
        t_exit = time.monotonic()
        long.thread.join(5)
        assert rc == 0, s.log[-20:]
        assert 10 <= t_exit - t_sig < 10 + 4, t_exit - t_sig
        assert long.status == 200 and long.done, long.events[-3:]
        last = long.chunks()[-1]
        _error(last, "shutting_down")
        assert "--shutdown-timeout" in last["error"]["message"]
        finishes = [c["choices"][0]["finish_reason"] for c in long.chunks()[:-1]]
        assert finishes.count("length") < 90  # it was cut, not finished
        plain_thread.join(5)
        assert plain[0].status_code == 503, plain[0].text
        assert "--shutdown-timeout" in _error(plain[0].json(), "shutting_down")["message"]


def test_sigint_drains_too_and_a_second_signal_ends_the_rest_at_once(engine_dir):
    with ServerProcess(engine_dir, "--device", "cpu") as s:  # --shutdown-timeout 30
        long = Stream(s.url, {"prompt": "a", "n": 16, "max_tokens": 480, "ignore_eos": True})
        assert long.first.wait(30)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(10) == 0, s.log[-20:]
        assert time.monotonic() - t0 < 4
        long.thread.join(5)
        assert long.done and "second signal" in _error(long.chunks()[-1])["message"]


def _serve(args: list[str], env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run([sys.executable, "-m", "kiln", "serve", *args], check=False,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_busy_port_fails_before_loading_the_engine(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        want = f"error: port {port} on 127.0.0.1 is in use; pick another with --port"
        # A source is built (seconds), then loaded; the port is checked before either.
        cache = tmp_path / "cache"
        r = _serve(["random:tiny-llama", "--port", str(port)], {"KILN_CACHE": str(cache)})
        assert r.returncode == 1, r.stderr
        assert r.stderr.strip().splitlines()[-1] == want, r.stderr
        assert "building" not in r.stderr and not (cache / "engines").exists()


def test_busy_port_fails_before_torch_is_imported(tmp_path):
    """The port is checked before torch is imported (seconds on its own), so a busy one fails
    within a second or two: here torch cannot even be imported."""
    blocker = tmp_path / "blocker" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    path = os.pathsep.join(p for p in (str(blocker.parent), os.environ.get("PYTHONPATH")) if p)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _serve(["random:tiny-llama", "--port", str(port)],
                   {"KILN_CACHE": str(tmp_path / "cache"), "PYTHONPATH": path})
        assert r.returncode == 1, r.stderr
        assert r.stderr.strip().splitlines()[-1] == (
            f"error: port {port} on 127.0.0.1 is in use; pick another with --port"), r.stderr


def _recv_all(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed."""
    sock.settimeout(limit_s)
    data = b""
    t0 = time.monotonic()
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {limit_s} s; got {data!r}")
    except ConnectionResetError:
        pass
    return data, time.monotonic() - t0


def _status_and_body(data: bytes) -> tuple[int, bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", head)
    assert m, data
    return int(m.group(1)), body


def test_slow_clients_are_cut_off(engine_dir):
    with ServerProcess(engine_dir, "--header-timeout", "1", "--body-timeout", "1.5") as s:
        host, port = s.url.removeprefix("http://").split(":")
        addr = (host, int(port))
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()

        # Headers trickled slower than the limit: 408, connection closed.
        with socket.create_connection(addr) as c:
            t0 = time.monotonic()
            for i in range(0, 30, 3):
                try:
                    c.sendall(head[i:i + 3])
                except OSError:
                    break
                time.sleep(0.25)
            data, _ = _recv_all(c, 5)
            assert time.monotonic() - t0 < 1 + 1.5
            assert _status_and_body(data)[0] == 408, data

        # A connection that sends nothing at all is closed too.
        with socket.create_connection(addr) as c:
            data, took = _recv_all(c, 5)
            assert took < 1 + 1.5

        # Headers complete, the body never finishes: 408 with an OpenAI error body.
        with socket.create_connection(addr) as c:
            c.sendall(head + body[:5])
            data, took = _recv_all(c, 5)
            assert took < 1.5 + 1.5
            status, payload = _status_and_body(data)
            assert status == 408, data
            err = _error(json.loads(payload), "request_timeout")
            assert "--body-timeout" in err["message"]

        # A body trickled slower than the limit allows in total: 408.
        with socket.create_connection(addr) as c:
            c.sendall(head)
            t0 = time.monotonic()
            for i in range(len(body)):
                try:
                    c.sendall(body[i:i + 1])
                except OSError:
                    break
                time.sleep(0.2)
                if time.monotonic() - t0 > 4:
                    break
            data, _ = _recv_all(c, 5)
            assert _status_and_body(data)[0] == 408, data

        # A client a little slow, but within both limits, is served, keep-alive and all.
        with socket.create_connection(addr) as c:
            for _ in range(2):
                c.sendall(head[:20])
                time.sleep(0.3)
                c.sendall(head[20:])
                time.sleep(0.3)
                c.sendall(body)
                c.settimeout(30)
                data = b""
                while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                    data += c.recv(65536)
                status, payload = _status_and_body(data)
                assert status == 200, data
                assert json.loads(payload)["choices"]
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200


def test_queue_limit_counts_only_requests_beyond_the_batch(engine_dir):
    with ServerProcess(engine_dir, "--max-queue", "4") as s:
        # 16 requests fit the batch of 16 at once: none of them is waiting for a slot.
        results: list[int] = []

        def one() -> None:
            r = httpx.post(s.url + "/v1/completions", timeout=60,
                           json={"prompt": [1, 2, 3], "max_tokens": 64, "ignore_eos": True})
            results.append(r.status_code)

        threads = [threading.Thread(target=one) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [200] * 16, results

        def aborted() -> float:
            text = httpx.get(s.url + "/metrics", timeout=10).text
            m = re.search(r"^kiln_requests_aborted_total(?:\{[^}]*\})? ([0-9.e+]+)$", text,
                          re.MULTILINE)
            return float(m.group(1)) if m else 0.0

        before = aborted()
        # 3 prompts x n=8 = 24 engine requests, more than 16 slots + --max-queue 4 ever hold:
        # no retry can help, so a 400 naming n (not a 429 a client would retry forever).
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "prompt": ["a", "b", "c"], "n": 8, "max_tokens": 200, "ignore_eos": True})
        assert r.status_code == 400, r.text
        assert "retry-after" not in r.headers
        err = _error(r.json(), "over_capacity")
        assert err["param"] == "n"
        assert "24" in err["message"] and "--max-queue 4" in err["message"]
        assert aborted() == before  # all or nothing: none of the 24 was added
        kv = httpx.get(s.url + "/debug/kv", timeout=10).json()
        assert kv["all_free"] and not kv["has_unfinished"], kv
        # Busy now: with one request running, 2 x n=10 = 20 more leave 5 waiting, more than
        # --max-queue 4: 429 with Retry-After, and none of the 20 is added.
        busy = Stream(s.url, {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True})
        assert busy.first.wait(30)
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "prompt": ["a", "b"], "n": 10, "max_tokens": 4})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        err = _error(r.json(), "queue_full")
        assert "20" in err["message"] and "--max-queue 4" in err["message"]
        busy.thread.join(60)
        assert busy.status == 200 and aborted() == before
        # 20 = 16 running + 4 waiting fits.
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "prompt": ["a", "b"], "n": 10, "max_tokens": 4})
        assert r.status_code == 200, r.text
