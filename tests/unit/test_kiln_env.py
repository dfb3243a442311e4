"""kiln/env.py: how the toolchain's environment variables (outside the runtime) read."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import env
from kiln.errors import KilnError


def test_cache_dir_defaults_to_home_and_expands_user(monkeypatch):
    monkeypatch.delenv("KILN_CACHE", raising=False)
    assert env.cache_dir() == Path.home() / ".cache" / "kiln"
    monkeypatch.setenv("KILN_CACHE", "")
    assert env.cache_dir() == Path.home() / ".cache" / "kiln"
    monkeypatch.setenv("KILN_CACHE", "~/elsewhere")
    assert env.cache_dir() == Path.home() / "elsewhere"


def test_debug_reads_the_usual_spellings_of_on(monkeypatch):
    for raw, want in (("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                      ("0", False), ("", False), ("no", False)):
        monkeypatch.setenv("KILN_DEBUG", raw)
        assert env.debug_enabled() is want
    monkeypatch.delenv("KILN_DEBUG")
    assert not env.debug_enabled()
    env.enable_debug()
    assert env.debug_enabled()
    monkeypatch.delenv("KILN_DEBUG")


def test_precompile_timeout_is_a_positive_number_of_seconds(monkeypatch):
    monkeypatch.delenv("KILN_PRECOMPILE_TIMEOUT_S", raising=False)
    assert env.precompile_timeout_s() == env.PRECOMPILE_TIMEOUT_S
    monkeypatch.setenv("KILN_PRECOMPILE_TIMEOUT_S", "2.5")
    assert env.precompile_timeout_s() == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("KILN_PRECOMPILE_TIMEOUT_S", bad)
        with pytest.raises(KilnError, match="is not a number of seconds > 0"):
            env.precompile_timeout_s()
