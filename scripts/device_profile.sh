#!/usr/bin/env bash
# Profiling pass on the lent H200, two back-to-back `run` calls (see device_issue6.sh for the
# GGUF halves and wheels):
# Call 1 (carry [".carry/a"], ~300 s):  bash scripts/device_profile.sh a   (llama-3-8b shapes)
# Call 2 (carry [".carry/b", ".whl"]):  bash scripts/device_profile.sh b   (smollm2-135m, GPU tests,
#                                       spec-step trace)
# Or w (FP8 W8A8 gemv tests and A/B; carry [".carry/a"]) then t (carry [".carry/b", ".whl"]:
# the lookahead trace, the smollm2 bench, profile_step). p / p1 / p2: the PDL session's calls.
# k: engine start-up on an empty Triton cache, with and without --precompile-kernels
#    (carry .carry/a too, then m right after with .carry/b + .whl: the MID_M trace, e2e).
# e1 / e2: the end-of-session targets and GPU tests (carry .carry/a + .whl, then .carry/b).
# c: the GEMV chain of an 8B FP8 step alone (bench_gemv_chain.py) with a config sweep.
# h: L2 hints of weights (gemv whole-slice / line hints, attention hinting o_proj) A/B.
# w1 then pace: adaptive speculation's break-even, graph replays vs whole engine steps
#    (prepared 2026-11-30 sixth session, not run yet). w1 then w2: wider lookahead windows and
#    the MID_M check (run). s / s2 / s3: where a cold start goes (profile_startup.py, jitlog);
#    v: `kiln serve` on an empty Triton cache with shipped kernels (run).
# g1 then pace2 (seventh session): the batch-1 step's time outside its CUDA graph
#    (step_gap.py, carry .carry/a), then the pacing knobs and the start-up break-even test.
# ab (eighth session): scripts/ablate_step.py, whole engine steps at 3 contexts per variant.
# f16 (eighth session): f16x2 accumulation A/B (code in the commit before its removal; it lost).
# l2 (eighth session): the next-weight L2 prefetch A/B (code in 0b91ba7, removed: it lost).
# f1 then f2 (ninth session): e1 / e2 without serve and the kernel tests.
# t1 then t2 (tenth session): new GPU tests, the graph-ends A/B (8B FP8 steps, smollm2 replays),
#    8B latency incl. an FP8 lm_head engine (carry .carry/a + .whl); then correctness and the
#    smollm2 bench with its sanity row (carry .carry/b + .whl). t3 then t2: the final targets;
#    t5: the per-row FP8 lm_head's GPU tests and latency. (Calls 1-2 and 7-8 of that session
#    ran t1 / t2 / t3 under the names g1 / g2 / g3, which shadowed the seventh session's.)
# u1 then u2 (eleventh session): 8B FP8 latency (default and --quantize-lm-head) with carry
#    .carry/a + .whl, then the real-GGUF correctness tests with carry .carry/b + .whl.
# v1 then v2 (twelfth session): the epilogue norm form's GPU tests and 8B latency (FP8, FP8
#    lm_head, bf16; carry .carry/a + .whl), then correctness incl. smollm2 on that form.
# x1 then x2 (twelfth session): 8B serve -> first answer (carry .carry/a + .whl), then the
#    smollm2 bench on the real GGUF (carry .carry/b + .whl).
# r1 then r2 (thirteenth session): the same-run transformers ratios, 8B bf16 batch 1 and
#    1024 requests 512 / 256; r3 then r4: serve (8B), then smollm2 with transformers in the
#    same run and the smollm2 bench (the GGUF halves: carry .carry/a, then .carry/b).
# pf1 then pf2 (thirteenth session): prefill graphs on / off (KILN_PREFILL_GRAPHS), 8B and
#    smollm2, and the real-GGUF correctness tests (carry .carry/a + .whl, then .carry/b + .whl).
# n: the fusion switches A/B (NORM_PROLOGUE, SILU_FUSION_MAX_K on 8B; measured 2026-11-30 fifth session).
set -uo pipefail
phase=${1:?usage: device_profile.sh a|b}
short=""
case "$phase" in f1) phase=e1; short=1 ;; f2) phase=e2; short=1 ;; esac  # e1 / e2, shorter
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 KILN_CACHE=/tmp/kcache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
install_wheels() {  # the pure-Python wheels the device lacks (.whl, carried)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
}
latency_8b() {  # kiln bench latency, 8B bf16 and FP8 engines (max batch 256), 128 in / 128 out
  # (LAT_VARIANTS: none fp8, and fp8-lmh = FP8 weights with --quantize-lm-head)
  for v in ${LAT_VARIANTS:-none fp8}; do
    q=${v%-lmh}; extra=""; [ "$v" != "$q" ] && extra="--quantize-lm-head"
    python3 -m kiln build random:llama-3-8b -o /tmp/l3-$v --dtype bfloat16 --max-seq-len 2048 \
      --max-num-tokens 8192 --max-batch-size 256 --quantization $q $extra --no-tune \
      --no-precompile-kernels --force > "$OUT/build-$v.log" 2>&1 || tail -3 "$OUT/build-$v.log"
    timeout 120 python3 -m kiln bench latency /tmp/l3-$v --batch-size 1 --input-len 128 \
      --output-len 128 --num-iters 5 --warmup 1 --json "$OUT/lat-$v.json" > "$OUT/lat-$v.log" 2>&1
  done
}
build_l3_none() {  # the 8B bf16 bench engine (max batch 256) in /tmp/l3-none
  python3 -m kiln build random:llama-3-8b -o /tmp/l3-none --dtype bfloat16 --max-seq-len 2048 \
    --max-num-tokens 8192 --max-batch-size 256 --no-tune --no-precompile-kernels --force \
    > "$OUT/build-none.log" 2>&1 || tail -3 "$OUT/build-none.log"
}
prefill_graphs_latency() {  # ENGINE NAME OUTPUT_LEN: batch-1 latency, 128-token prompts,
  # prefill graphs off then on (KILN_PREFILL_GRAPHS)
  for pg in 0 1; do
    KILN_PREFILL_GRAPHS=$pg timeout 150 python3 -m kiln bench latency "$1" --batch-size 1 \
      --input-len 128 --output-len "$3" --num-iters 5 --warmup 1 \
      --json "$OUT/lat-$2-pg$pg.json" > "$OUT/lat-$2-pg$pg.log" 2>&1
    echo "== $2, KILN_PREFILL_GRAPHS=$pg"
    grep -i "TTFT\|TPOT\|tokens/s\|start-up\|graphs\|warning" "$OUT/lat-$2-pg$pg.log" | head -8
  done
}
join_gguf() {  # the smollm2 GGUF from the half left in /tmp/parts and the carried .carry/b
  mkdir -p /tmp/kcache/smollm2-135m
  cat /tmp/parts/smolpart.aa .carry/b/smolpart.ab \
    > /tmp/kcache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
}
correctness_gguf() {  # the real-GGUF correctness tests (carry .carry/b + .whl, after a call
  # that left the first half in /tmp/parts)
  install_wheels || return 1
  join_gguf || return 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 280 python3 -m pytest -q tests/gpu/test_cuda_correctness.py -k "not eager and not torch" \
    > "$OUT/correctness.log" 2>&1
  tail -3 "$OUT/correctness.log"
}
if [ "$phase" = ab ]; then  # kernel ablation / A/B at real contexts (scripts/ablate_step.py)
  export PYTHONPATH=.:scripts
  for q in ${AB_QUANTS:-fp8}; do
    timeout ${AB_S:-400} python3 scripts/ablate_step.py --quant $q \
      --variants ${AB_VARIANTS:-base,w_evict_normal,noskip,splits32} \
      --prompt-lens ${AB_PROMPTS:-128,512,1792} > "$OUT/ablate-$q.log" 2>&1
    grep "^|" "$OUT/ablate-$q.log" || tail -20 "$OUT/ablate-$q.log"
  done
elif [ "$phase" = t1 ]; then  # tenth session, call 1 (carry .carry/a + .whl)
  mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/
  install_wheels || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 150 python3 -m pytest -q tests/gpu/test_gemv_gpu.py tests/gpu/test_kernels_gpu.py \
    -k "float32_logits or graph_end or elementwise or (real_shapes and not mid_m)" \
    > "$OUT/gpu_new.log" 2>&1
  tail -2 "$OUT/gpu_new.log"
  LAT_VARIANTS="fp8-lmh fp8 none" latency_8b
  for f in "$OUT"/lat-*.log; do echo "== $f"; grep -i "tok/s\|TPOT\|start-up" "$f" | head -6; done
  timeout 150 python3 scripts/ablate_step.py --quant fp8 --variants base,torch_ends,base,torch_ends \
    --prompt-lens 128 > "$OUT/ablate-ends.log" 2>&1
  grep "^|" "$OUT/ablate-ends.log" || tail -5 "$OUT/ablate-ends.log"
  timeout 80 python3 scripts/bench_pdl.py --only smol --modes 2 --knob llama.FUSED_ENDS=1,0 \
    > "$OUT/pdl-ends.log" 2>&1
  grep "^|" "$OUT/pdl-ends.log" || tail -5 "$OUT/pdl-ends.log"
elif [ "$phase" = t3 ]; then  # tenth session, final call 1 (carry .carry/a + .whl); t2 after it
  mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/
  install_wheels || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 90 python3 scripts/gemv_hot_cold.py --dtypes fp8 --shapes lm_head > "$OUT/lmh_sweep.log" 2>&1
  grep "^|" "$OUT/lmh_sweep.log" | tail -10
  LAT_VARIANTS="fp8-lmh fp8 none" latency_8b
  for f in "$OUT"/lat-*.log; do echo "== $f"; grep -i "tok/s\|TPOT\|start-up" "$f" | head -6; done
  timeout 170 python3 -m kiln bench throughput /tmp/l3-none --num-prompts 1024 --input-len 512 \
    --output-len 256 --json "$OUT/tput.json" > "$OUT/tput.log" 2>&1
  tail -12 "$OUT/tput.log"
elif [ "$phase" = u1 ]; then  # eleventh session, final call 1 (carry .carry/a + .whl); u2 after
  mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/
  install_wheels || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  LAT_VARIANTS="fp8 fp8-lmh" latency_8b
  for f in "$OUT"/lat-*.log; do echo "== $f"; grep -i "tok/s\|TPOT\|start-up" "$f" | head -6; done
elif [ "$phase" = u2 ] || [ "$phase" = v2 ]; then  # right after u1 / v1 (carry .carry/b +
  # .whl): correctness, real GGUF (v2: also smollm2 forced onto the epilogue norm form)
  correctness_gguf || exit 1
elif [ "$phase" = x1 ] || [ "$phase" = r3 ]; then  # twelfth session (carry .carry/a +
  # .whl): serve -> first answer, 8B (r3: the same, thirteenth session)
  mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/
  install_wheels || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 150 python3 scripts/bench_fast_path.py --only serve --out "$OUT/serve.json" \
    > "$OUT/serve.log" 2>&1
  tail -6 "$OUT/serve.log"
elif [ "$phase" = x2 ]; then  # right after x1 (carry .carry/b + .whl): smollm2 b1 + lookahead
  install_wheels || exit 1
  join_gguf || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 200 python3 scripts/bench_fast_path.py --only smol --smol-configs fast \
    --out "$OUT/smol.json" > "$OUT/smol.log" 2>&1
  tail -16 "$OUT/smol.log"
elif [ "$phase" = r1 ]; then  # thirteenth session: 8B bf16 batch-1 latency with transformers
  # (static cache + torch.compile) in the same run (carry nothing extra)
  build_l3_none
  timeout 420 python3 -m kiln bench latency /tmp/l3-none --batch-size 1 --input-len 128 \
    --output-len 128 --num-iters 5 --warmup 1 --baseline hf --json "$OUT/lat-hf.json" \
    > "$OUT/lat-hf.log" 2>&1
  tail -25 "$OUT/lat-hf.log"
elif [ "$phase" = r2 ]; then  # right after r1 (the engine in /tmp/l3-none): 1024 requests
  # 512 / 256 with transformers' generate_batch on 256 of them in the same run
  [ -d /tmp/l3-none ] || build_l3_none
  timeout 560 python3 -m kiln bench throughput /tmp/l3-none --num-prompts 1024 --input-len 512 \
    --output-len 256 --baseline hf --baseline-num-prompts 256 --json "$OUT/tput-hf.json" \
    > "$OUT/tput-hf.log" 2>&1
  tail -25 "$OUT/tput-hf.log"
elif [ "$phase" = r4 ]; then  # right after r3 (carry .carry/b + .whl): smollm2 batch 1 with
  # transformers (static cache + compile) in the same run, then the smollm2 bench (lookahead)
  install_wheels || exit 1
  join_gguf || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  python3 -m kiln build smollm2-135m -o /tmp/smol-bf16 --dtype bfloat16 --no-tune --force \
    > "$OUT/build-smol.log" 2>&1 || tail -3 "$OUT/build-smol.log"
  timeout 240 python3 -m kiln bench latency /tmp/smol-bf16 --batch-size 1 --input-len 128 \
    --output-len 256 --num-iters 5 --warmup 1 --baseline hf --json "$OUT/lat-smol-hf.json" \
    > "$OUT/lat-smol-hf.log" 2>&1
  tail -12 "$OUT/lat-smol-hf.log"
  timeout 220 python3 scripts/bench_fast_path.py --only smol --smol-configs fast \
    --out "$OUT/smol.json" > "$OUT/smol.log" 2>&1
  tail -16 "$OUT/smol.log"
elif [ "$phase" = pf1 ]; then  # thirteenth session: prefill graphs A/B on 8B bf16 (carry
  # .carry/a + .whl): batch-1 latency on a default-sized engine (max batch 64: prompts past
  # 64 tokens used to prefill eagerly), then 1024 requests on the max-batch-256 engine
  mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/
  python3 -m kiln build random:llama-3-8b -o /tmp/l3-b64 --dtype bfloat16 --max-seq-len 2048 \
    --no-tune --no-precompile-kernels --force > "$OUT/build-b64.log" 2>&1 \
    || tail -3 "$OUT/build-b64.log"
  prefill_graphs_latency /tmp/l3-b64 b64 128
  [ -d /tmp/l3-none ] || build_l3_none
  for pg in 0 1; do
    KILN_PREFILL_GRAPHS=$pg timeout 150 python3 -m kiln bench throughput /tmp/l3-none \
      --num-prompts 1024 --input-len 512 --output-len 256 --json "$OUT/tput-pg$pg.json" \
      > "$OUT/tput-pg$pg.log" 2>&1
    echo "== 8B 1024 x 512/256, KILN_PREFILL_GRAPHS=$pg"
    grep -i "output tokens/s\|elapsed\|start-up\|graphs\|warning" "$OUT/tput-pg$pg.log" | head -6
  done
elif [ "$phase" = pf2 ]; then  # right after pf1 (carry .carry/b + .whl): smollm2 A/B, tests
  install_wheels || exit 1
  join_gguf || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  python3 -m kiln build smollm2-135m -o /tmp/smol-bf16 --dtype bfloat16 --no-tune --force \
    > "$OUT/build-smol.log" 2>&1 || tail -3 "$OUT/build-smol.log"
  prefill_graphs_latency /tmp/smol-bf16 smol 256
  timeout 240 python3 -m pytest -q tests/gpu/test_cuda_correctness.py \
    -k "not eager and not torch" > "$OUT/correctness.log" 2>&1
  tail -3 "$OUT/correctness.log"
elif [ "$phase" = v1 ]; then  # twelfth session, final call 1 (carry .carry/a + .whl); v2 after
  mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/
  install_wheels || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 120 python3 -m pytest -q tests/gpu/test_gemv_gpu.py \
    -k "residual_norm_linear or (real_shapes and not mid_m)" > "$OUT/gpu_gemv.log" 2>&1
  tail -2 "$OUT/gpu_gemv.log"
  LAT_VARIANTS="fp8 fp8-lmh none" latency_8b
  for f in "$OUT"/lat-*.log; do echo "== $f"; grep -i "tok/s\|TPOT\|start-up" "$f" | head -6; done
elif [ "$phase" = t5 ]; then  # tenth session: the per-row FP8 lm_head (tests, latency)
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 120 python3 -m pytest -q tests/gpu/test_gemv_gpu.py \
    -k "per_row or float32_logits or (real_shapes and not mid_m)" > "$OUT/gpu_rows.log" 2>&1
  tail -2 "$OUT/gpu_rows.log"
  LAT_VARIANTS="fp8-lmh" latency_8b
  grep -i "tok/s\|TPOT" "$OUT"/lat-fp8-lmh.log | head -4
elif [ "$phase" = t2 ]; then  # right after t1 or t3 (carry .carry/b + .whl)
  correctness_gguf || exit 1
  timeout 200 python3 scripts/bench_fast_path.py --only smol --smol-configs fast \
    --out "$OUT/smol.json" > "$OUT/smol.log" 2>&1
  tail -30 "$OUT/smol.log"
elif [ "$phase" = q ]; then  # quick: no GGUF (random smollm2 weights), tiny-model GPU tests
  timeout 200 python3 scripts/profile_8b.py --only ${PROFILE_8B:-b1,fp8,tput} \
    --out "$OUT/profile_8b.json" > "$OUT/profile_8b.log" 2>&1
  timeout 100 python3 scripts/profile_step.py --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1
  timeout 120 python3 -m pytest -q -x tests/gpu/test_cuda_correctness.py -k "not smollm2" \
    > "$OUT/gpu_tests.log" 2>&1
  timeout 90 python3 -m pytest -q tests/gpu/test_kernels_gpu.py tests/gpu/test_gemv_gpu.py \
    -k "rotary_and_cache or silu_and_mul or elementwise or reshape" >> "$OUT/gpu_tests.log" 2>&1
  grep -E "passed|failed|error" "$OUT/gpu_tests.log"; grep -E "^llama|kernels per|_kernel" \
    "$OUT/profile_8b.log" | head -40; tail -8 "$OUT/profile.log"
elif [ "$phase" = w ]; then  # FP8 small-batch W8A8: GPU tests, A/B timing (carry .carry/a)
  [ -d .carry/a ] && mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/
  timeout 200 python3 -m pytest -q tests/gpu/test_gemv_gpu.py > "$OUT/gemv_tests.log" 2>&1
  timeout 120 python3 scripts/bench_w8a8.py > "$OUT/w8a8.log" 2>&1
  tail -4 "$OUT/gemv_tests.log"; grep -E "^\||^M=|H200" "$OUT/w8a8.log"
elif [ "$phase" = t ]; then  # right after w (GGUF half a in /tmp/parts): lookahead trace
  install_wheels || exit 1
  join_gguf || exit 1
  timeout 120 python3 scripts/trace_spec_step.py --steps 20 --out "$OUT" > "$OUT/trace.log" 2>&1
  timeout 150 python3 scripts/bench_fast_path.py --only smol --smol-configs fast \
    --out "$OUT/smol.json" > "$OUT/smol.log" 2>&1
  timeout 100 python3 scripts/profile_step.py --windows "7,7,7" --out "$OUT/profile.json" \
    > "$OUT/profile.log" 2>&1
  grep -v "USDT\|Converting" "$OUT/trace.log" | tail -40; tail -10 "$OUT/smol.log"
  tail -30 "$OUT/profile.log"
elif [ "$phase" = p ]; then  # PDL session, call 1 (carry .carry/a): mid-M A/B, 8B latency
  [ -d .carry/a ] && mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 90 python3 -m pytest -q tests/gpu/test_gemv_gpu.py -k "mid_m or routes or dispatch or pdl" \
    > "$OUT/gemv_tests.log" 2>&1
  timeout 100 python3 scripts/bench_pdl.py --only smol --modes 2 --mid-m 1,0 \
    --out "$OUT/pdl_mid.json" > "$OUT/pdl_mid.log" 2>&1
  latency_8b
  tail -2 "$OUT/gemv_tests.log"; grep "^|" "$OUT/pdl_mid.log"; tail -n 15 "$OUT"/lat-*.log
elif [ "$phase" = p2 ]; then  # PDL session, call 2 (carry .carry/b, .whl; right after p1)
  install_wheels || exit 1
  join_gguf || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 300 python3 -m pytest -q tests/gpu/test_cuda_correctness.py -k "not eager and not torch" \
    > "$OUT/correctness.log" 2>&1
  timeout 130 python3 scripts/bench_pdl.py --only smol --modes 2 --mid-m 1,0 \
    --out "$OUT/pdl_smol.json" > "$OUT/pdl_smol.log" 2>&1
  timeout 170 python3 scripts/bench_fast_path.py --only smol --smol-configs fast \
    --out "$OUT/smol.json" > "$OUT/smol.log" 2>&1
  tail -3 "$OUT/correctness.log"; grep "^|" "$OUT/pdl_smol.log"; tail -12 "$OUT/smol.log"
elif [ "$phase" = n ]; then  # next: the fusion switches (off, unmeasured), A/B on 8B + smollm2
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 120 python3 -m pytest -q tests/gpu/test_gemv_gpu.py -k "add_rms_norm or pdl" \
    > "$OUT/fusion_tests.log" 2>&1
  timeout 420 python3 scripts/bench_pdl.py --modes 2 --norm-prologue 0,1 \
    --silu-max-k 4096,16384 --out "$OUT/fusion.json" > "$OUT/fusion.log" 2>&1
  tail -2 "$OUT/fusion_tests.log"; grep "^|" "$OUT/fusion.log"
elif [ "$phase" = h ]; then  # L2 hints of read-only weights: GPU bit-identity tests, A/B
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 150 python3 -m pytest -q tests/gpu/test_gemv_gpu.py tests/gpu/test_kernels_gpu.py \
    -k "pdl or hint or add_rms_norm" > "$OUT/hint_tests.log" 2>&1
  # (the whole-slice and attention-kernel hints of a660562 lost and were removed)
  timeout 420 python3 scripts/bench_pdl.py --modes 2 --knob gemv.PREFETCH_HINT_BYTES=32,128 \
    --out "$OUT/hints.json" > "$OUT/hints.log" 2>&1
  tail -2 "$OUT/hint_tests.log"; grep "^|" "$OUT/hints.log"
elif [ "$phase" = c ]; then  # the GEMV chain alone (8B FP8) with a per-shape config sweep
  # (this session's calls 3 and 4 also A/B'd two kernel variants, since removed: x in W's
  # layout, a quarter-width accumulator, a folded accumulator; see notes/NOTES.md)
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 280 python3 scripts/bench_gemv_chain.py --sweep --budget-s 200 \
    --out "$OUT/chain.json" > "$OUT/chain.log" 2>&1
  grep -A200 "^NVIDIA" "$OUT/chain.log" | grep -v "split" | head -20
  grep "split" "$OUT/chain.log" | sort -t'|' -k3 -n | head -12
elif [ "$phase" = e1 ]; then  # end of session, call 1 (carry .carry/a, .whl): 8B targets
  mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/
  install_wheels || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  latency_8b
  timeout 170 python3 -m kiln bench throughput /tmp/l3-none --num-prompts 1024 --input-len 512 \
    --output-len 256 --json "$OUT/tput.json" > "$OUT/tput.log" 2>&1
  tail -n 14 "$OUT"/lat-*.log; tail -12 "$OUT/tput.log"
  if [ -z "$short" ]; then
    timeout 90 python3 scripts/bench_fast_path.py --only serve --out "$OUT/serve.json" \
      > "$OUT/serve.log" 2>&1
    timeout 120 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k sampling \
      > "$OUT/sampling_tests.log" 2>&1
    tail -3 "$OUT/serve.log"; tail -2 "$OUT/sampling_tests.log"
  fi
elif [ "$phase" = e2 ]; then  # right after e1 (carry .carry/b): smollm2, correctness, kernels
  join_gguf || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 300 python3 -m pytest -q tests/gpu/test_cuda_correctness.py -k "not eager and not torch" \
    > "$OUT/correctness.log" 2>&1
  timeout 170 python3 scripts/bench_fast_path.py --only smol --smol-configs fast \
    --out "$OUT/smol.json" > "$OUT/smol.log" 2>&1
  tail -3 "$OUT/correctness.log"; tail -14 "$OUT/smol.log"
  if [ -z "$short" ]; then
    timeout 150 python3 -m pytest -q tests/gpu/test_kernels_gpu.py > "$OUT/kernels.log" 2>&1
    tail -2 "$OUT/kernels.log"
  fi
elif [ "$phase" = k ]; then  # start-up on an empty Triton cache, with and without shipped kernels
  [ -d .carry/a ] && mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/  # for m next
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 120 python3 -m pytest -q tests/gpu/test_kernel_cache_gpu.py > "$OUT/kcache_test.log" 2>&1
  for p in no-precompile-kernels precompile-kernels; do
    python3 -m kiln build random:llama-3-8b -o /tmp/l3-$p --dtype bfloat16 --max-seq-len 2048 \
      --max-num-tokens 8192 --max-batch-size 256 --no-tune --$p --force > "$OUT/build-$p.log" 2>&1
    for run in 1 2; do  # each start on its own empty Triton cache (a fresh machine's)
      TRITON_CACHE_DIR=$(mktemp -d) timeout 120 python3 -m kiln bench latency /tmp/l3-$p \
        --batch-size 1 --input-len 16 --output-len 16 --num-iters 1 --warmup 0 \
        > "$OUT/cold-$p-$run.log" 2>&1
    done
  done
  tail -1 "$OUT/kcache_test.log"; grep -h "precompiled\|warning" "$OUT"/build-*.log
  for f in "$OUT"/cold-*.log; do echo "$f"; grep -A1 "engine start-up" "$f"; done
elif [ "$phase" = s ]; then  # where a cold start goes: per-bucket capture + cProfile, cold then warm
  [ -d .carry/a ] && mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/  # for m next
  export PYTHONPATH=/tmp/site:.:scripts
  python3 -m kiln build random:llama-3-8b -o /tmp/l3s --dtype bfloat16 --max-seq-len 2048 \
    --max-num-tokens 8192 --max-batch-size 256 --no-tune --force > "$OUT/build.log" 2>&1
  tc=$(mktemp -d)
  for run in cold warm; do
    TRITON_CACHE_DIR=$tc timeout 150 python3 scripts/profile_startup.py /tmp/l3s \
      --out "$OUT/prof-$run.txt" > "$OUT/start-$run.log" 2>&1
  done
  TRITON_CACHE_DIR=$tc timeout 100 python3 scripts/profile_startup.py /tmp/l3s --no-profile \
    > "$OUT/start-warm-noprof.log" 2>&1
  for run in cold warm; do head -25 "$OUT/start-$run.log"; grep -A30 "Ordered by: cumulative" "$OUT/start-$run.log" | head -40; done
  head -3 "$OUT/start-warm-noprof.log"
elif [ "$phase" = s2 ]; then  # why the shipped kernels missed: JIT specialisations, build vs start
  export PYTHONPATH=/tmp/site:scripts/jitlog:.:scripts
  KILN_JIT_LOG=$OUT/jit-build.txt python3 -m kiln build random:llama-3-8b -o /tmp/l3p \
    --dtype bfloat16 --max-seq-len 2048 --max-num-tokens 8192 --max-batch-size 256 --no-tune \
    --precompile-kernels --force > "$OUT/build.log" 2>&1
  tc=$(mktemp -d)
  KILN_JIT_LOG=$OUT/jit-start.txt TRITON_CACHE_DIR=$tc timeout 150 python3 \
    scripts/profile_startup.py /tmp/l3p --no-profile > "$OUT/start.log" 2>&1
  tail -2 "$OUT/build.log"; head -1 "$OUT/start.log"; wc -l "$OUT"/jit-*.txt
  python3 scripts/jitlog/diff.py "$OUT/jit-build.txt" "$OUT/jit-start.txt" > "$OUT/diff.txt" 2>&1
  cut -c1-600 "$OUT/diff.txt" | head -40
  ls /tmp/l3p/kernels/*/ | sort > "$OUT/shipped.txt"; ls "$tc" | sort > "$OUT/after.txt"
  echo "after-start entries not shipped: $(comm -13 "$OUT/shipped.txt" "$OUT/after.txt" | wc -l)"
elif [ "$phase" = s3 ]; then  # the start on installed kernels under cProfile, then again
  export PYTHONPATH=/tmp/site:.:scripts
  [ -d /tmp/l3p/kernels ] || python3 -m kiln build random:llama-3-8b -o /tmp/l3p --dtype bfloat16 \
    --max-seq-len 2048 --max-num-tokens 8192 --max-batch-size 256 --no-tune \
    --precompile-kernels --force > "$OUT/build.log" 2>&1
  tc=$(mktemp -d)
  for run in 1 2; do
    TRITON_CACHE_DIR=$tc timeout 150 python3 scripts/profile_startup.py /tmp/l3p \
      --out "$OUT/prof-$run.txt" > "$OUT/start-$run.log" 2>&1
    head -1 "$OUT/start-$run.log"; grep -A28 "Ordered by: internal" "$OUT/start-$run.log" | cut -c1-200
  done
  ls -la ~/.nv/ComputeCache 2>&1 | head -3; du -sh ~/.nv ~/.triton 2>&1
elif [ "$phase" = v ]; then  # serve start on an empty Triton cache (kernels shipped); MID_M check
  install_wheels || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 200 python3 scripts/bench_fast_path.py --only serve --out "$OUT/serve.json" \
    > "$OUT/serve.log" 2>&1
  python3 -m kiln build random:tiny-llama -o /tmp/tiny --force > "$OUT/build_default.log" 2>&1
  KILN_ADAPTIVE_SPECULATION=0 timeout 240 python3 scripts/mid_m_check.py > "$OUT/mid.log" 2>&1
  tail -3 "$OUT/serve.log"; grep -o '"ready_line": "[^"]*"' "$OUT/serve.json" | head -c 600
  echo; tail -2 "$OUT/build_default.log"; grep -v "^ " "$OUT/mid.log" | tail -6
elif [ "$phase" = w1 ]; then  # the GGUF's first half to /tmp/parts (carry .carry/a); w2 right after
  mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/ && ls -la /tmp/parts
elif [ "$phase" = w2 ]; then  # (carry .carry/b, .whl) wider lookahead windows; MID_M on real weights
  install_wheels || exit 1
  join_gguf || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  KILN_ADAPTIVE_SPECULATION=0 timeout 230 python3 scripts/bench_windows.py \
    --out "$OUT/windows-always.json" > "$OUT/windows-always.log" 2>&1
  KILN_ADAPTIVE_SPECULATION=0 timeout 100 python3 scripts/mid_m_check.py > "$OUT/mid.log" 2>&1
  timeout 200 python3 scripts/bench_windows.py --windows "7,7,7;15,5,15;7,7,15;15,7,15" \
    --out "$OUT/windows-adaptive.json" > "$OUT/windows-adaptive.log" 2>&1
  grep -v "^ *[0-9.]* us" "$OUT/windows-always.log" | tail -8; grep MID_M "$OUT/mid.log"
  tail -5 "$OUT/windows-adaptive.log"
elif [ "$phase" = g1 ]; then  # seventh session (carry .carry/a): GGUF half a; the step gap
  mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 400 python3 scripts/step_gap.py --out "$OUT/step_gap.json" > "$OUT/step_gap.log" 2>&1
  tail -32 "$OUT/step_gap.log"
elif [ "$phase" = g2 ]; then  # (no carry) sampling kernels: GPU tests, then the step gap A/B
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 120 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k sampling \
    > "$OUT/sampling_tests.log" 2>&1
  timeout 150 python3 -m pytest -q tests/gpu/test_cuda_correctness.py -k "tiny or break_even" \
    > "$OUT/correctness.log" 2>&1
  timeout 400 python3 scripts/step_gap.py --out "$OUT/step_gap.json" > "$OUT/step_gap.log" 2>&1
  tail -2 "$OUT/sampling_tests.log"; tail -2 "$OUT/correctness.log"; tail -40 "$OUT/step_gap.log"
elif [ "$phase" = pace2 ]; then  # right after g1 (carry .carry/b, .whl): pacing knobs, GPU test
  install_wheels || exit 1
  join_gguf || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 100 python3 -m pytest -q -s tests/gpu/test_cuda_correctness.py -k "break_even" \
    > "$OUT/break_even_test.log" 2>&1
  timeout 400 python3 scripts/bench_pacing.py --repeats 2 --out "$OUT/pacing.json" \
    --policies "replay,wall:12:12:2,wall:12:4:2,wall:12:4:4,wall:8:4:4" > "$OUT/pacing.log" 2>&1
  grep -E "passed|failed|break-even [0-9]" "$OUT/break_even_test.log"
  grep -v "Converting" "$OUT/pacing.log" | tail -11
elif [ "$phase" = pace3 ]; then  # right after w1 (carry .carry/b, .whl): the early pause A/B
  install_wheels || exit 1
  join_gguf || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 400 python3 scripts/bench_pacing.py --repeats 2 --prompts-per-set 6 \
    --out "$OUT/pacing.json" --policies "wall,wall:12:12:2:4:0.5,wall:12:12:2:6:0.5" \
    > "$OUT/pacing.log" 2>&1
  grep -v "Converting" "$OUT/pacing.log" | tail -7
elif [ "$phase" = pace ]; then  # right after w1 (carry .carry/b, .whl): pacing break-even A/B
  install_wheels || exit 1
  join_gguf || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 400 python3 scripts/bench_pacing.py --repeats 2 --out "$OUT/pacing.json" \
    > "$OUT/pacing.log" 2>&1
  grep -v "Converting" "$OUT/pacing.log" | tail -8
elif [ "$phase" = m ]; then  # right after k with .carry/a (carry .carry/b, .whl): MID_M puzzle
  install_wheels || exit 1
  join_gguf || exit 1
  export PYTHONPATH=/tmp/site:.:scripts
  timeout 200 python3 scripts/trace_spec_step.py --steps 20 --mid-m 0,1 --out "$OUT" \
    > "$OUT/trace_mid.log" 2>&1
  timeout 300 python3 scripts/bench_pdl.py --only smol --modes 2 --mid-m 0,1 \
    --out "$OUT/mid.json" > "$OUT/mid.log" 2>&1
  grep -v "USDT\|Converting" "$OUT/trace_mid.log" | tail -60; grep "^|" "$OUT/mid.log"
elif [ "$phase" = p1 ]; then  # the first half of the GGUF, and the kernel tests
  mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/
  timeout 120 python3 -m pytest -q tests/gpu/test_kernels_gpu.py > "$OUT/kernels.log" 2>&1
  tail -3 "$OUT/kernels.log"
elif [ "$phase" = a ]; then
  mkdir -p /tmp/parts && cp .carry/a/smolpart.aa /tmp/parts/
  timeout ${PROFILE_8B_S:-420} python3 scripts/profile_8b.py --only ${PROFILE_8B:-b1,fp8,tput} \
    --out "$OUT/profile_8b.json" > "$OUT/profile_8b.log" 2>&1
  tail -80 "$OUT/profile_8b.log"
else
  install_wheels || exit 1
  join_gguf || exit 1
  timeout 200 python3 -m pytest -q -x tests/gpu > "$OUT/gpu_tests.log" 2>&1
  timeout 150 python3 scripts/bench_fast_path.py --only smol --out "$OUT/smol.json" \
    > "$OUT/smol.log" 2>&1
  timeout 100 python3 scripts/profile_step.py --windows "7,7,7" --out "$OUT/profile.json" \
    > "$OUT/profile.log" 2>&1
  # a lookahead step vs a plain step: device busy vs host time, chrome traces in $OUT
  timeout 90 python3 scripts/trace_spec_step.py --steps 20 --out "$OUT" > "$OUT/trace.log" 2>&1
  tail -5 "$OUT/gpu_tests.log"; tail -10 "$OUT/smol.log"; tail -30 "$OUT/profile.log"
  grep -v "USDT\|Converting" "$OUT/trace.log" | tail -24
fi
