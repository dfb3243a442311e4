"""kiln/runtime/env.py: how the runtime's environment variables read."""

from __future__ import annotations

import pytest

from kiln.runtime import env
from kiln.runtime.engine import RuntimeConfig


def test_env_flag_reads_unset_as_the_default_and_0_or_empty_as_off(monkeypatch):
    monkeypatch.delenv("KILN_TEST_FLAG", raising=False)
    assert env.env_flag("KILN_TEST_FLAG", True) and not env.env_flag("KILN_TEST_FLAG", False)
    for raw, want in (("0", False), ("", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("KILN_TEST_FLAG", raw)
        assert env.env_flag("KILN_TEST_FLAG", True) is want


def test_runtime_config_defaults_come_from_the_environment(monkeypatch):
    for name in ("KILN_CUDA_GRAPHS", "KILN_PREFILL_GRAPHS", "KILN_ASYNC_SCHEDULING",
                 "KILN_ADAPTIVE_SPECULATION", "KILN_ATTENTION_BACKEND", "KILN_RESERVE_KV"):
        monkeypatch.delenv(name, raising=False)
    cfg = RuntimeConfig()
    assert cfg.attention_backend == "auto"
    assert cfg.cuda_graphs and cfg.prefill_graphs and cfg.async_scheduling
    assert cfg.adaptive_speculation and cfg.reserve_kv
    monkeypatch.setenv("KILN_RESERVE_KV", "0")
    assert not RuntimeConfig().reserve_kv
    monkeypatch.setenv("KILN_ATTENTION_BACKEND", "torch")
    monkeypatch.setenv("KILN_PREFILL_GRAPHS", "0")
    cfg = RuntimeConfig()
    assert cfg.attention_backend == "torch" and not cfg.prefill_graphs and cfg.cuda_graphs


def test_pdl_mode_is_read_once_and_checked(monkeypatch):
    env.pdl_mode.cache_clear()
    try:
        monkeypatch.delenv("KILN_PDL", raising=False)
        assert env.pdl_mode() == 2
        monkeypatch.setenv("KILN_PDL", "0")
        assert env.pdl_mode() == 2  # cached
        env.pdl_mode.cache_clear()
        assert env.pdl_mode() == 0
        env.pdl_mode.cache_clear()
        monkeypatch.setenv("KILN_PDL", "3")
        with pytest.raises(ValueError, match="KILN_PDL='3' must be 0"):
            env.pdl_mode()
    finally:
        env.pdl_mode.cache_clear()
