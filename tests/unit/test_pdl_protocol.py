"""Programmatic dependent launch protocol (kiln/runtime/kernels/_pdl.py), checked statically:
a kernel launched with ``launch_pdl`` may start before the previous kernel has finished, so it
must wait (``pdl_begin(PDL)``) before it reads or writes anything but weights. A new kernel
that forgets the wait would race only on a Hopper GPU, so the rule is checked here on CPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # like the other kernel tests (order-proof)

import ast
import inspect
import re
from pathlib import Path

import pytest

pytest.importorskip("triton")

KERNELS = Path(__file__).resolve().parents[2] / "kiln" / "runtime" / "kernels"
# before the wait: index arithmetic, and the GEMV's L2 hints of its (read-only) weights
ALLOWED_BEFORE_WAIT = {"_prefetch_slice"}
MEMORY_OPS = re.compile(r"\btl\.(load|store|atomic_\w+)\(")


def _kernel_modules() -> list[Path]:
    return sorted(p for p in KERNELS.glob("*.py") if "@triton.jit" in p.read_text())


def _launched_kernels(src: str) -> list[tuple[str, str]]:
    """(kernel name, the launch call's source) for every ``name[grid](...)`` launch."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)):
            out.append((node.func.value.id, ast.get_source_segment(src, node)))
    return out


def test_every_launch_passes_the_pdl_arguments():
    launches = 0
    for path in _kernel_modules():
        for name, call in _launched_kernels(path.read_text()):
            launches += 1
            assert "**_pdl.launch_kwargs(" in call, f"{path.name}: {name} launched without PDL"
    assert launches >= 9  # gemv x2, attention x2, rms_norm, silu, kv write, rotary x2, ...


def test_every_launched_kernel_waits_before_touching_memory():
    import importlib

    checked = staged = 0
    for path in _kernel_modules():
        mod = importlib.import_module(f"kiln.runtime.kernels.{path.stem}")
        for name, _ in _launched_kernels(path.read_text()):
            fn = getattr(mod, name)
            assert "PDL" in fn.arg_names, f"{name} has no PDL constexpr"
            body = inspect.getsource(fn.fn)
            body = body[body.index("):\n") + 3:]  # past the signature
            before = body[: body.index("pdl_begin(PDL)")]
            assert not MEMORY_OPS.search(before), f"{name} touches memory before the wait"
            calls = set(re.findall(r"\b(_\w+)\(", before)) - ALLOWED_BEFORE_WAIT
            assert not calls, f"{name} calls {calls} before the wait"
            if "STAGED_EARLY" in fn.arg_names:
                _check_staged_early(name, body)
                staged += 1
            checked += 1
    assert checked >= 9
    assert staged >= 4  # attention, rotary, rotary + KV write, rms_norm


# STAGED_EARLY: what a kernel may read before its wait besides weights: the step's
# metadata that the host uploads before the step's kernels and no kernel writes, and
# constant tables. Loads go through these pointers (directly, or through these helpers).
STAGED_POINTERS = {"qsl_ptr", "ctx_ptr", "mask_off_ptr", "pos_ptr", "cache_ptr", "slot_ptr",
                   "bt_ptr", "w_ptr"}  # w_ptr: the norm kernel's weight (read-only)
STAGED_HELPERS = {"_find_seq", "_cos_sin"}
# L2 prefetches are safe on any address (L2 is the point of coherence): these helpers may be
# given any pointer, and themselves load only the block table (bt_row = bt_ptr + ...)
PREFETCH_HELPERS = {"_prefetch_kv": "bt_row"}


def _check_staged_early(name: str, body: str) -> None:
    """The section between ``if not STAGED_EARLY: pdl_begin`` and ``if STAGED_EARLY:
    pdl_begin`` stores nothing and loads only through STAGED_POINTERS."""
    body = re.sub(r"#.*", "", body)
    first = body.index("pdl_begin(PDL)")
    assert body[:first].rstrip().endswith("if not STAGED_EARLY:"), name
    second = body.index("pdl_begin(PDL)", first + 1)
    early = body[first + len("pdl_begin(PDL)"): second]
    assert early.rstrip().endswith("if STAGED_EARLY:"), name
    assert not re.search(r"\btl\.(store|atomic_\w+)\(", early), f"{name} writes before the wait"
    for ptr in re.findall(r"\btl\.load\(\s*(\w+)", early):
        assert ptr in STAGED_POINTERS, f"{name} loads {ptr} before the wait"
    for helper, args in re.findall(r"\b(_\w+)\(([^)]*)\)", early):
        if helper in PREFETCH_HELPERS:
            _check_prefetch_helper(helper)
            continue
        assert helper in STAGED_HELPERS, f"{name} calls {helper} before the wait"
        ptrs = {a.strip() for a in args.split(",") if a.strip().endswith("_ptr")}
        assert ptrs <= STAGED_POINTERS, f"{name} passes {ptrs - STAGED_POINTERS} to {helper}"


def _check_prefetch_helper(helper: str) -> None:
    from kiln.runtime.kernels import paged_attention

    src = re.sub(r"#.*", "", inspect.getsource(getattr(paged_attention, helper).fn))
    assert not re.search(r"\btl\.(store|atomic_\w+)\(", src), f"{helper} writes"
    loads = re.findall(r"\btl\.load\(\s*(\w+)", src)
    assert loads and set(loads) == {PREFETCH_HELPERS[helper]}, f"{helper} loads {loads}"
