"""Registers per thread of the one-row GEMV variants, compiled for sm_90 on this GPU-less
machine (Triton's CUDA backend to PTX, then ptxas -v). The 8B step's GEMVs sit exactly at a
register-file boundary (the 8-warp FP8 producer at 64 on the H200: 4 programs per SM; the
4-warp consumers at 72: 7), so any fused variant must be checked against it before a GPU
call. The counts here come from this machine's Triton, which may differ from the lent
GPU's (2026-11-30: 74 here vs 64 there for the same 8-warp kernel): compare variants with
each other, and read the GPU's own counts with ``scripts/norm_fusion_probe.py``.

    python3 scripts/kernel_registers.py        (PTXAS=/path/to/ptxas to pick one)
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "unit")]

import sm90_compile as sc  # tests/unit: the sm_90 signatures
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kiln.runtime.kernels import gemv

BASE = dict(sc.GEMV_ONE_ROW, HAS_SCALE=1)
CASES = {  # name: (constexprs over BASE, warps, FP8 weights)
    "FP8 qkv 8x512": ({}, 4, True),
    "FP8 gate_up 16x256": ({"BLOCK_N": 16, "BLOCK_K": 256}, 4, True),
    "FP8 o_proj 8x1024": ({"BLOCK_K": 1024}, 8, True),
    "FP8 down 8x1024 silu": ({"BLOCK_K": 1024, "ACT": True}, 8, True),
    "FP8 o_proj residual epilogue (prologue form)": ({"BLOCK_K": 1024, "RES_EPI": 1}, 8, True),
    "FP8 o_proj residual epilogue (epilogue form)": ({"BLOCK_K": 1024, "RES_EPI": 2}, 8, True),
    "FP8 gate_up normalising loads": ({"BLOCK_N": 16, "BLOCK_K": 256, "PRENORM": 1,
                                       "NPART_PAD": 512}, 4, True),
    "FP8 gate_up 1/rms epilogue": ({"BLOCK_N": 16, "BLOCK_K": 256, "PRENORM": 2,
                                    "NPART_PAD": 512}, 4, True),
    "bf16 o_proj 16x1024": ({"BLOCK_N": 16, "BLOCK_K": 1024, "HAS_SCALE": 0, "ESIZE": 2},
                            8, False),
    "bf16 o_proj residual epilogue (epilogue form)": (
        {"BLOCK_N": 16, "BLOCK_K": 1024, "HAS_SCALE": 0, "ESIZE": 2, "RES_EPI": 2}, 8, False),
}


def find_ptxas() -> str:
    found = os.environ.get("PTXAS") or shutil.which("ptxas") or next(
        iter(sorted(glob.glob("/usr/local/cuda*/bin/ptxas"), reverse=True)), None)
    if not found:
        sys.exit("no ptxas found: set PTXAS=/path/to/ptxas (CUDA 12.8+)")
    return found


def registers(ptx: str, ptxas: str) -> str:
    arch = "sm_90a" if ".target sm_90a" in ptx else "sm_90"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        # this Triton may emit a newer PTX ISA than the ptxas at hand; the kernels use none of it
        f.write(ptx.replace(".version 9.4", ".version 9.0"))
    r = subprocess.run([ptxas, f"-arch={arch}", "-v", f.name, "-o", os.devnull],
                       capture_output=True, text=True, check=False)
    os.unlink(f.name)
    lines = [ln for ln in r.stderr.splitlines() if "registers" in ln]
    return lines[-1].split("Used")[1].strip() if lines else r.stderr.strip()[-200:]


def main() -> None:
    ptxas = find_ptxas()
    target = GPUTarget("cuda", 90, 32)
    for name, (over, warps, fp8) in CASES.items():
        const = dict(BASE, **over)
        sig, cst = sc.signature(gemv._gemv_kernel, const, {"w_ptr": "*fp8e4nv"} if fp8 else None)
        k = triton.compile(ASTSource(gemv._gemv_kernel, sig, cst,
                                     sc.divisibility(gemv._gemv_kernel, cst)),
                           target=target, options={"num_warps": warps, "launch_pdl": True})
        print(f"{name:48s} {warps} warps: {registers(k.asm['ptx'], ptxas)}")


if __name__ == "__main__":
    main()
