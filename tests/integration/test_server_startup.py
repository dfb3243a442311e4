"""`kiln serve` reports its start-up time: stderr line, /health and /metrics."""

from __future__ import annotations

import re
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kiln.server.testing import ServerProcess


def test_ready_line_health_and_metrics(tmp_path):
    from kiln.builder import build_engine

    out = tmp_path / "tiny"
    build_engine("random:tiny-llama", out, dtype="float32", max_seq_len=128, max_batch_size=2,
                 progress=False)
    with ServerProcess(out) as s:  # its log holds stdout and stderr
        lines = [ln for ln in s.log if ln.startswith("kiln serve: ready in ")]
        assert len(lines) == 1, s.log
        m = re.fullmatch(r"kiln serve: ready in (\d+\.\d) s \((.+ \d+\.\d s)\)", lines[0])
        assert m, lines[0]
        assert m.group(2).endswith(" s") and "server " in m.group(2)
        # one line: the limits it serves, its running batch and KV cache, and where from
        sizing = [ln for ln in s.log if ln.startswith("kiln serve: max_seq_len ")]
        assert len(sizing) == 1 and re.fullmatch(
            r"kiln serve: max_seq_len 128 \(engine\), max_num_tokens 8,192 \(engine\), "
            r"running batch 2 \(engine max_batch_size; the KV pool holds [\d,]+ sequences of "
            r"128 tokens\), KV cache [\d,]+ blocks x 16 = [\d,]+ tokens \(.+\)", sizing[0]), s.log
        health = httpx.get(s.url + "/health", timeout=30).json()
        assert health["status"] == "ok" and health["startup_s"] >= float(m.group(1)) - 0.06
        assert "server_s" in health["startup"]
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
        value = re.search(r"^kiln_startup_seconds ([0-9.e+-]+)$", metrics, re.MULTILINE)
        assert value and float(value.group(1)) == pytest.approx(health["startup_s"], abs=1e-3)
        assert 'kiln_startup_phase_seconds{phase="server"}' in metrics
        # the default --log-level (warning) logs no line per request
        httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2},
                   timeout=30)
        time.sleep(0.3)
        assert not [ln for ln in s.log if "/v1/completions" in ln or "/health" in ln], s.log
