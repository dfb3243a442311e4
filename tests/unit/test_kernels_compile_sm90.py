"""kiln's Triton kernels compile for sm_90 (H100/H200) on this GPU-less machine: PTX and a
cubin through Triton's bundled ptxas, with the PDL wait in every kernel. The interpreter
tests check the numbers; this checks what only the GPU compiler sees (code generation, the
griddepcontrol intrinsics, the GEMV's inline-PTX L2 prefetch). A subprocess, because the
other kernel tests switch this process to TRITON_INTERPRET."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# find_spec, not importorskip: importing triton here, before the interpreter tests set
# TRITON_INTERPRET, would turn their kernels into real JIT functions when this file runs first
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)


def test_every_kernel_compiles_for_sm90_with_the_pdl_wait():
    script = Path(__file__).with_name("sm90_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=600, check=False)
    if "No module named 'triton.backends.nvidia" in res.stderr:
        pytest.skip("this triton has no CUDA backend")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["failed"] == [], "\n".join(out["failed"])
    assert len(out["compiled"]) == 48, out["compiled"]
