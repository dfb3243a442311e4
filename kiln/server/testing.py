"""Start a real `kiln serve` subprocess for tests and benchmarks, and stop it afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


class ServerProcess:
    """``python -m kiln serve ENGINE --port 0 --json ...`` as a context manager.

    Waits for the JSON ready line (the bound URL) and for /health; ``url`` is the base URL.
    Output is kept in ``log`` (a list of lines) for failure messages.
    """

    def __init__(self, engine: str | Path, *args: str, timeout_s: float = 120.0,
                 env: dict[str, str] | None = None):
        self.cmd = [sys.executable, "-m", "kiln", "serve", str(engine), "--port", "0",
                    "--json", *args]
        self.timeout_s = timeout_s
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log: list[str] = []

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=self.env)
        ready = threading.Event()

        def pump() -> None:
            for line in self.proc.stdout:
                self.log.append(line.rstrip("\n"))
                if not ready.is_set() and line.startswith("{"):
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if obj.get("event") == "ready":
                        self.url = obj["url"]
                        ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kiln serve did not start:\n" + "\n".join(self.log[-40:]))
        return self

    def stop(self, drain_s: float = 10.0) -> int | None:
        """Stop the server; returns its exit code. SIGTERM lets requests in flight finish for
        up to ``drain_s``; a second SIGTERM ends the rest at once; SIGKILL if even that hangs.
        """
        if self.proc is None:
            return None
        for signal_it, wait_s in ((self.proc.terminate, drain_s), (self.proc.terminate, 10.0),
                                  (self.proc.kill, 10.0)):
            if self.proc.poll() is not None:
                break
            signal_it()
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.returncode

    def __exit__(self, *exc) -> None:
        self.stop()
