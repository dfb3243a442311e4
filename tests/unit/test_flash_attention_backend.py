"""The flash-attn backend's choice logic on the CPU: which steps flash-attn-4 takes, and the
fallback to the Triton kernels (package absent, or a step it refuses). Its numbers against
the torch reference are tests/gpu/test_flash_attention_gpu.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from kiln.runtime.layers import flash_attention
from kiln.runtime.layers.attention_registry import BACKENDS, TRITON_BACKENDS, get_backend
from kiln.runtime.layers.flash_attention import FlashAttention
from kiln.runtime.layers.triton_attention import TritonAttention


def _q(dtype=torch.bfloat16, head_dim=128, cuda=True):
    return SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=(7, 32, head_dim))


def _dm(max_query_len=7, mask=None):
    return SimpleNamespace(max_query_len=max_query_len, mask=mask, query_start_loc="qsl",
                           context_lens="ctx", block_tables="tables")


def test_registered_beside_triton():
    assert "flash-attn" in BACKENDS and "flash-attn" in TRITON_BACKENDS
    with pytest.raises(ValueError, match="flash-attn"):
        get_backend("flash_attn")


def test_without_the_package_it_is_triton(monkeypatch):
    monkeypatch.setattr(flash_attention, "_import", lambda: None)
    b = get_backend("flash-attn")
    assert isinstance(b, TritonAttention) and not b.takes(_q(), _q(), _dm())


def test_import_failure_is_one_warning(monkeypatch, caplog):
    import builtins

    real = builtins.__import__

    def no_flash(name, *a, **kw):
        if name.startswith("flash_attn"):
            raise ImportError("No module named 'flash_attn'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_flash)
    with caplog.at_level(logging.WARNING, "kiln.attention"):
        assert flash_attention._import() is None
    assert len(caplog.records) == 1 and "Triton" in caplog.text


@pytest.mark.parametrize("q, dm, takes", [
    (_q(), _dm(), True),                            # a prompt step
    (_q(), _dm(max_query_len=1), False),            # decode: Triton
    (_q(), _dm(mask="tree"), False),                # a speculative tree step: Triton
    (_q(dtype=torch.float32), _dm(), False),        # float32: no flash kernels
    (_q(head_dim=80), _dm(), False),                # no kernels for that head size
    (_q(cuda=False), _dm(), False),                 # CPU (the Triton interpreter)
])
def test_which_steps_it_takes(q, dm, takes, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    b = FlashAttention(varlen=lambda *a, **kw: None)
    assert b.takes(q, q, dm) is takes


def test_fp8_cache_stays_on_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    b = FlashAttention(varlen=lambda *a, **kw: None)
    assert not b.takes(_q(), _q(dtype=torch.float8_e4m3fn), _dm())


def test_runs_flash_and_falls_back_once(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(TritonAttention, "_attend",
                        staticmethod(lambda *a: calls.append("triton") or "triton-out"))
    monkeypatch.setattr(FlashAttention, "takes", lambda self, q, kc, dm: self.varlen is not None)

    def varlen(q, k, v, **kw):
        assert kw["page_table"] == "tables" and kw["seqused_k"] == "ctx" and kw["causal"]
        return "flash-out", "lse"

    b = FlashAttention(varlen=varlen)
    assert b._attend("q", "k", "v", _dm(), 0.1, 1.0, 1.0) == "flash-out"

    def refuses(*a, **kw):
        raise RuntimeError("unsupported page size")

    b = FlashAttention(varlen=refuses)
    with caplog.at_level(logging.WARNING, "kiln.attention"):
        assert b._attend("q", "k", "v", _dm(), 0.1, 1.0, 1.0) == "triton-out"
        assert b._attend("q", "k", "v", _dm(), 0.1, 1.0, 1.0) == "triton-out"
    assert calls == ["triton", "triton"] and len(caplog.records) == 1
    assert "unsupported page size" in caplog.text


def test_no_flash_under_graph_capture(monkeypatch):
    """A capture would bake in a kernel flash-attn-4 compiles on first use: Triton there."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not FlashAttention(varlen=lambda *a, **kw: None).takes(_q(), _q(), _dm())
