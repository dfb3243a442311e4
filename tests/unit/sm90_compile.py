"""Compile kiln's Triton kernels for sm_90 (H100/H200) without a GPU: Triton's CUDA backend
lowers to PTX and runs ptxas on the host. Catches what the CPU interpreter cannot: code
generation errors, the PDL intrinsics, inline PTX (the GEMV's L2 prefetch). Compiled with
the real launches' specialisation (16-byte-divisible pointers and GEMV shapes), so the PTX is
the one the GPU runs: the one-row FP8 GEMV must load its weights 16 bytes at a time.

Run in a process without TRITON_INTERPRET (the kernels must be real JIT functions):
    python tests/unit/sm90_compile.py   -> one JSON line {"compiled": [...], "failed": [...]}
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

I32_PTRS = {"bt_ptr", "qsl_ptr", "ctx_ptr", "slot_ptr", "pos_ptr", "mask_off_ptr"}
F32_PTRS = {"ss_ptr", "scale_ptr", "k_scale_ptr", "v_scale_ptr", "part_ptr", "part_acc_ptr",
            "part_ml_ptr", "xs_ptr", "scale_out_ptr", "cache_ptr"}
F32_SCALARS = {"eps", "qk_scale", "inv_temp"}


def signature(fn, constexprs: dict, ptr_types: dict | None = None):
    sig, const = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in constexprs:
            sig[a] = "constexpr"
            const[(i,)] = constexprs[a]
        elif a.endswith("_ptr"):
            sig[a] = (ptr_types or {}).get(a) or (
                "*i32" if a in I32_PTRS else "*fp32" if a in F32_PTRS
                else "*u8" if a == "mask_ptr" else "*bf16")
        else:
            sig[a] = "fp32" if a in F32_SCALARS else "i32"
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for constexprs {missing}")
    return sig, const


# The one-row FP8 CUDA-core GEMV's constexprs (8 x 512 tiles, PDL and its prefetch, no
# fusion); cases vary them.
GEMV_ONE_ROW = {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "USE_DOT": False, "EVEN_K": True,
                "SPLIT": False, "HAS_SCALE": True, "HAS_BIAS": False, "WIDEN": False,
                "ACT": False, "X_FP8": False, "PDL": True, "PREFETCH": True, "ESIZE": 1,
                "NORM": False, "K_PAD": 1, "HINT": 128, "W_EVICT": "evict_first",
                "RES_EPI": 0, "PRENORM": 0, "NPART_PAD": 1}


def cases():
    from kiln.runtime.kernels import (
        activation,
        fp8_quant,
        gemv_kernel,
        kv_write,
        lookahead,
        ngram,
        paged_attention,
        rms_norm,
        rotary,
        sampling,
    )

    g = GEMV_ONE_ROW
    fp8w = {"w_ptr": "*fp8e4nv"}
    yield "gemv W8A16 M=1 prefetch", gemv_kernel._gemv_kernel, g, fp8w, 8
    yield "gemv W8A16 M=1 sector hints", gemv_kernel._gemv_kernel, dict(g, HINT=32), fp8w, 8
    yield "gemv W8A16 M=1 per-row scale", gemv_kernel._gemv_kernel, dict(g, HAS_SCALE=2), fp8w, 8
    yield "gemv W8A16 M=1 add+rmsnorm", gemv_kernel._gemv_kernel, dict(g, NORM=True, K_PAD=4096), \
        fp8w, 8
    yield "gemv W8A16 M=1 residual epilogue, silu", gemv_kernel._gemv_kernel, dict(
        g, RES_EPI=1, ACT=True), fp8w, 8
    yield "gemv W8A16 M=1 pre-normed", gemv_kernel._gemv_kernel, dict(g, PRENORM=1, NPART_PAD=512), \
        fp8w, 8
    yield "gemv W8A16 M=1 residual epilogue, h * g out", gemv_kernel._gemv_kernel, dict(
        g, RES_EPI=2, ACT=True, BLOCK_K=1024), fp8w, 8
    yield "gemv W8A16 M=1 1/rms epilogue", gemv_kernel._gemv_kernel, dict(
        g, PRENORM=2, NPART_PAD=512), fp8w, 4
    yield "gemv bf16 M=4 silu split", gemv_kernel._gemv_kernel, dict(
        g, BLOCK_M=4, ACT=True, SPLIT=True, HAS_SCALE=False, PREFETCH=False, ESIZE=2), None, 8
    yield "gemv bf16 tensor cores", gemv_kernel._gemv_kernel, dict(
        g, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, USE_DOT=True, HAS_SCALE=False, PREFETCH=False,
        ESIZE=2), None, 4
    w8a8 = dict(g, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, USE_DOT=True, X_FP8=True,
                PREFETCH=False)
    yield "gemv W8A8 tensor cores", gemv_kernel._gemv_kernel, w8a8, {
        "w_ptr": "*fp8e4nv", "x_ptr": "*fp8e4nv"}, 4
    yield "gemv W8A8 tensor cores, per-token x scales", gemv_kernel._gemv_kernel, dict(
        w8a8, X_FP8=2), {"w_ptr": "*fp8e4nv", "x_ptr": "*fp8e4nv"}, 4
    reduce = {"SPLIT_K": 4, "HAS_SCALE": True, "HAS_BIAS": True, "X_FP8": False,
              "BLOCK": 1024, "PDL": True}
    yield "gemv split-K reduce", gemv_kernel._splitk_reduce_kernel, reduce, None, 4
    yield "gemv split-K reduce, per-token x scales", gemv_kernel._splitk_reduce_kernel, dict(
        reduce, X_FP8=2), None, 4
    norm = {"HAS_RESIDUAL": True, "GATHER": False, "WRITE_RES": True, "FP8_OUT": 0,
            "BLOCK": 4096, "PDL": True, "STAGED_EARLY": True}
    yield "add+rmsnorm", rms_norm._rms_norm_kernel, norm, None, 8
    yield "embedding + rmsnorm", rms_norm._rms_norm_kernel, dict(
        norm, HAS_RESIDUAL=False, GATHER=True), {"rows_ptr": "*i64"}, 8
    yield "add + logit rows + rmsnorm", rms_norm._rms_norm_kernel, dict(
        norm, GATHER=True, WRITE_RES=False), {"rows_ptr": "*i64"}, 8
    e4m3_out = {"out_ptr": "*fp8e4nv"}
    yield "add+rmsnorm, e4m3 out, per-token scales", rms_norm._rms_norm_kernel, dict(
        norm, FP8_OUT=2), e4m3_out, 8
    yield "embedding + rmsnorm, e4m3 out, static scale", rms_norm._rms_norm_kernel, dict(
        norm, HAS_RESIDUAL=False, GATHER=True, FP8_OUT=1), {**e4m3_out, "rows_ptr": "*i64"}, 8
    yield "silu_and_mul", activation._silu_and_mul_kernel, {"BLOCK": 1024, "PDL": True}, None, 4
    yield "silu_and_mul, e4m3 out, per-token scales (two passes)", \
        activation._silu_and_mul_fp8_kernel, {"DYNAMIC": True, "BLOCK": 4096,
                                              "ONE_PASS": False, "PDL": True}, e4m3_out, 8
    yield "silu_and_mul, e4m3 out, static scale", activation._silu_and_mul_fp8_kernel, {
        "DYNAMIC": False, "BLOCK": 2048, "ONE_PASS": True, "PDL": True}, e4m3_out, 4
    kv = {"IS_FP8": True, "H_PAD": 8, "D_PAD": 128, "PDL": True}
    yield "kv write fp8", kv_write._kv_write_kernel, kv, {
        "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"}, 4
    yield "rotary + cache", rotary._rotary_cache_kernel, {
        "IS_FP8": False, "QH_PAD": 32, "KH_PAD": 8, "HALF_PAD": 64, "PDL": True,
        "STAGED_EARLY": True}, None, 4
    yield "rotary + cache fp8", rotary._rotary_cache_kernel, {
        "IS_FP8": True, "QH_PAD": 32, "KH_PAD": 8, "HALF_PAD": 64, "PDL": True,
        "STAGED_EARLY": True}, {"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"}, 4
    rot = {"QH_PAD": 32, "KH_PAD": 8, "HALF_PAD": 64, "PDL": True, "STAGED_EARLY": False}
    yield "rotary", rotary._rotary_kernel, rot, None, 4
    attn = {"QPK": 4, "HEAD_DIM": 128, "D_PAD": 128, "BLOCK_SIZE": 16, "BLOCK_Q": 4,
            "BLOCK_M": 16, "BLOCK_N": 64, "MULTI": True, "HAS_MASK": True, "KV_FP8": False,
            "Q_F32": False, "IEEE": False, "PDL": True,
            "STAGED_EARLY": False, "KV_PREFETCH": 0, "LINE": 64, "D_LINES": 2, "V_ASM": 0,
            "BT_AHEAD": False}
    yield "paged attention (tree mask, splits)", paged_attention._paged_attn_kernel, attn, None, 4
    yield "paged attention decode, K/V prefetch", paged_attention._paged_attn_kernel, dict(
        attn, HAS_MASK=False, STAGED_EARLY=True, KV_PREFETCH=2), None, 4
    yield ("paged attention decode, FP8 K/V (float16 dots)", paged_attention._paged_attn_kernel,
           dict(attn, HAS_MASK=False, KV_FP8=True, BLOCK_N=128, LINE=128, D_LINES=1,
                V_ASM=1),
           {"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"}, 4)
    yield ("paged attention decode, FP8 V as 32-bit words", paged_attention._paged_attn_kernel,
           dict(attn, HAS_MASK=False, KV_FP8=True, BLOCK_N=128, LINE=128, D_LINES=1,
                V_ASM=2), {"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"}, 4)
    yield ("paged attention decode, FP8 K/V, block ids a tile ahead",
           paged_attention._paged_attn_kernel,
           dict(attn, HAS_MASK=False, KV_FP8=True, BLOCK_N=64, LINE=128, D_LINES=1,
                V_ASM=1, BT_AHEAD=True), {"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"}, 4)
    yield "paged attention reduce", paged_attention._reduce_kernel, {
        "HEAD_DIM": 128, "D_PAD": 128, "S_PAD": 16, "PDL": True}, None, 4
    samp = {"val_ptr": "*fp32", "idx_ptr": "*i32", "logits_ptr": "*fp32", "inv_temp_ptr": "*fp32",
            "key_ptr": "*i64"}
    samp = dict(samp, plan_slot_ptr="*i64", plan_r0_ptr="*i64", depth_ptr="*i64",
                thr_ptr="*fp32")
    part = {"BLOCK": 2048, "PDL": True, "WARP": False}
    yield "sampling partial (per-row temperature)", sampling._sample_partial_kernel, dict(
        part, PER_ROW=True, ROW_KEYS=False, PLANS=False), samp, 4
    yield "sampling partial (per-row Philox keys)", sampling._sample_partial_kernel, dict(
        part, PER_ROW=False, ROW_KEYS=True, PLANS=False), samp, 4
    yield "sampling partial (speculative plans)", sampling._sample_partial_kernel, dict(
        part, PER_ROW=False, ROW_KEYS=True, PLANS=True), samp, 4
    yield "sampling partial (speculative plans, top-k / top-p / min-p)", \
        sampling._sample_partial_kernel, dict(part, PER_ROW=False, ROW_KEYS=True, PLANS=True,
                                              WARP=True), samp, 4
    warp = dict(samp, warp_ptr="*fp32", stats_ptr="*fp32", cand_ptr="*fp32")
    yield "warped plan rows: per-part max, mass and 64 largest", sampling._warp_parts_kernel, {
        "BLOCK": 2048, "M": 64, "PDL": True}, warp, 4
    yield "warped plan rows: thresholds", sampling._warp_threshold_kernel, {
        "BLOCK_P": 32, "BLOCK_C": 2048, "M": 64, "BLOCK": 256, "WAYS": 16, "PDL": True}, warp, 4
    yield "sampling final", sampling._sample_final_kernel, {"BLOCK_P": 64, "PDL": True}, dict(
        samp, out_ptr="*i64"), 1
    la = {"W": 7, "N": 7, "G": 7, "WL_PAD": 64, "G_PAD": 8, "N1_PAD": 8, "PDL": True}
    la_ptrs = {a: "*i64" for a in lookahead._lookahead_commit_kernel.arg_names
               + lookahead._lookahead_propose_kernel.arg_names if a.endswith("_ptr")}
    la_ptrs.update(hist_ptr="*i32", valid_ptr="*i1")
    yield "lookahead propose (7,7,7) into the input ids", lookahead._lookahead_propose_kernel, \
        dict(la, MAXM=3, MINM=1, BLOCK=256, WRITE_IDS=True), dict(la_ptrs, ids_ptr="*i32"), 4
    yield "lookahead commit (7,7,7)", lookahead._lookahead_commit_kernel, dict(la, N_PAD=8), \
        la_ptrs, 1
    yield "lookahead fold of plain steps' tokens (7,7,7)", lookahead._lookahead_fold_kernel, {
        "N": 7, "G": 7, "G_PAD": 8, "N1_PAD": 8, "PDL": True}, {
        a: "*i32" if a == "hist_ptr" else "*i64"
        for a in lookahead._lookahead_fold_kernel.arg_names if a.endswith("_ptr")}, 1
    yield "lookahead KV move (7,7,7), bf16 kvh2 d128", lookahead._move_kv_kernel, {
        "BS": 16, "H": 2, "D": 128, "E_PAD": 256, "N1": 6, "N1_PAD": 8, "PDL": True}, {
        "k_ptr": "*i16", "v_ptr": "*i16", "sm_ptr": "*i32", "q0_ptr": "*i64",
        "count_ptr": "*i64", "src_ptr": "*i64"}, 4
    yield "lookahead rows staged ahead, shifted (7,7,7)", lookahead._shift_rows_kernel, {
        "BS": 16, "T": 84, "T_PAD": 128, "PDL": True}, {
        a: "*i32" if a in ("pos_ptr", "cache_slots_ptr", "ctx_ptr", "bt_ptr") else "*i64"
        for a in lookahead._shift_rows_kernel.arg_names if a.endswith("_ptr")}, 1
    ng_ptrs = {a: "*i64" for a in ngram._ngram_propose_kernel.arg_names
               + ngram._ngram_commit_kernel.arg_names if a.endswith("_ptr")}
    ng_ptrs.update(hist_ptr="*i32", ids_ptr="*i32")
    yield "ngram propose (draft 8, match 3) into the input ids", ngram._ngram_propose_kernel, {
        "MAXM": 3, "MINM": 1, "D": 8, "T_PAD": 16, "BLOCK": 256, "WRITE_IDS": True,
        "PDL": True}, ng_ptrs, 4
    yield "ngram commit (draft 8)", ngram._ngram_commit_kernel, {
        "D": 8, "T_PAD": 16, "PDL": True}, ng_ptrs, 1
    yield "fp8 quant, static scale", fp8_quant._quant_kernel, {
        "ROWS": 4, "BLOCK_K": 1024, "PDL": True}, {"out_ptr": "*fp8e4nv"}, 4
    yield "fp8 quant, per-token scales", fp8_quant._quant_rows_kernel, {
        "BLOCK_K": 4096, "ONE_PASS": True, "PDL": True}, {"out_ptr": "*fp8e4nv"}, 8


# kernels that read the step's staged metadata before their PDL wait (_pdl.staged_early)
STAGED_EARLY = ("paged attention decode, K/V prefetch", "rotary + cache", "rotary + cache fp8")


# Integer arguments that are multiples of 16 at the real launches (the GEMV's shapes and
# strides at llama-3-8b / smollm2 sizes): a launch specialises them, and pointers, on
# divisibility by 16, which is what lets the compiler emit 16-byte vector loads.
DIVISIBLE_INTS = {"K", "N", "K_SPLIT", "stride_xm", "stride_wn", "stride_ym"}
# The attention kernel's q / out / cache strides (multiples of the head dim) are too; the
# block table's row stride need not be.
ATTENTION_DIVISIBLE = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb",
                       "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh"}


def divisibility(fn, const: dict) -> dict:
    """The launch's specialisation: 16-divisible pointers, DIVISIBLE_INTS for the GEMV and
    ATTENTION_DIVISIBLE for paged attention (whose K/V tiles are then loaded asynchronously)."""
    ints = {"_gemv_kernel": DIVISIBLE_INTS,
            "_paged_attn_kernel": ATTENTION_DIVISIBLE}.get(fn.__name__, set())
    return {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
            if (i,) not in const and (a.endswith("_ptr") or a in ints)}


def main() -> None:
    target = GPUTarget("cuda", 90, 32)
    compiled, failed = [], []
    for name, fn, constexprs, ptr_types, warps in cases():
        try:
            sig, const = signature(fn, constexprs, ptr_types)
            k = triton.compile(ASTSource(fn, sig, const, divisibility(fn, const)),
                               target=target, options={"num_warps": warps, "launch_pdl": True})
            ptx = k.asm.get("ptx", "")
            if "griddepcontrol.wait" not in ptx:
                raise AssertionError("no griddepcontrol.wait in the PTX (PDL wait missing)")
            if name.startswith("gemv W8A16") and "L2::evict_first" not in ptx:
                raise AssertionError("no L2::evict_first weight loads in the PTX")
            if name.startswith("gemv W8A16") and "L2::cache_hint.v4.b32" not in ptx:
                raise AssertionError("the e4m3 weights are not loaded 16 bytes at a time")
            wait = ptx.find("griddepcontrol.wait")
            if name in STAGED_EARLY and not 0 <= ptx.find("ld.global") < wait:
                raise AssertionError("the staged metadata is not read before the wait")
            if "a tile ahead" in name and not re.search(r"memdesc<[2-9]x", k.asm["ttgir"]):
                raise AssertionError("the K/V tiles are not multi-buffered (block ids ahead)")
            if "32-bit words" in name and ("ld.shared.b8" in ptx or "ldmatrix.sync.aligned"
                                           ".m8n8.x4.trans" not in ptx):
                raise AssertionError("FP8 V is read from shared memory a byte at a time, or "
                                     "not as float16 through ldmatrix.trans")
            if ("prefetch" in name or "hints" in name) and "prefetch.global.L2" not in ptx:
                raise AssertionError("no prefetch.global.L2 in the PTX (L2 hints missing)")
            compiled.append(name)
        except Exception as e:
            failed.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    print(json.dumps({"compiled": compiled, "failed": failed}))


if __name__ == "__main__":
    main()
