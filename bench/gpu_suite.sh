#!/usr/bin/env bash
# The GPU benchmarks and GPU tests in named suites. From the repository root on a GPU machine:
#   MINIVLLM_COMMIT=<sha of the tree> [OUT=DIR] bash bench/gpu_suite.sh SUITE [SUITE ...]
#   ... bash bench/gpu_suite.sh SUITE@GPUS [SUITE@GPUS ...]   e.g. latency@0 w1@1 tp_faults@2,3
# SUITE@GPUS runs each suite on its own GPUs (CUDA_VISIBLE_DEVICES), all at the same time, and waits for all; its
# log is $LOGS/<suite>.out, printed when all have ended. Suites that share a host this way share its CPU cores.
# Suites (result files <benchmark>_<gpu>.json in $OUT, default bench/results, overwritten):
#   regression    GPU tests needing no model file; W1 + single stream against the roofline measured in the same
#                 run (throughput_w1); serving at 1/4/16/64 users on dummy Llama-3-8B (serve)
#   spec          speculation and default-model GPU tests (engine, GGUF); the real model at batch 1 (spec_decode),
#                 under load (spec_decode_load), plain vs verify step (spec_decode_steps), verify per k (spec_decode_verify)
#   quant         quantization GPU tests; dummy Llama-3-8B per weight format (quant, quant_lmhead_fp8kv) and
#                 Llama-3-70B int4/fp8 on one GPU (quant_70b)
#   quality       perplexity over 100k held-out tokens per variant (quant_quality), needs .carry/p/{heldout,calib}.txt;
#   quality-int4  appends the slower int4 rows (awq, sequential gptq) to it
#   models        model-family GPU tests; dummy Qwen3-30B-A3B, Mixtral-8x7B and GPT-2 XL, the fused MoE kernel
#                 (models); the few-token MoE GEMVs' tiles timed apart (moe_gemv_sweep); the MoE models with 8-bit
#                 weights, experts included (models_fp8)
#   lora          LoRA GPU tests; the LoRA kernels per Llama-3-8B layer against the base GEMMs (lora_kernels); dummy
#                 Llama-3-8B with 8 adapters against the base model (lora)
#   imports       the engine's import profile (python -X importtime), slowest modules first
#   features      structured outputs (structured) and swap-to-CPU preemption (swap) with their GPU tests
#   soak          256 streaming clients for 5 minutes (soak); the dashboard's cost (dashboard_cost)
#   latency       a Poisson rate sweep with goodput, --max-itl-ms $ITL_MS against a baseline server without it; cold
#                 start with an empty and a warm Triton cache; safetensors loading of the 8B shapes (all merged
#                 into serve_<gpu>.json; run after `regression`, whose serve step writes that file anew)
#   parallel      2+ GPUs: GPU tests of tests/test_tp.py, bench/tp_bench.py (tp_<gpu>x2)
#   tp_faults     2+ GPUs: the GPU tests of tests/test_tp.py that need no model file (graphs, dead/stalled rank)
#   tp_default    4 GPUs: TP = 2 and 4 on the default model in fp32 against TP = 1 (needs the GGUF)
#   tp4           4 GPUs: Llama-3-70B at TP = 4 (tp_<gpu>x4)
#   w1            W1 + single stream against the roofline measured in the same run (throughput_w1)
#   spec_tests    speculation GPU tests (needs the GGUF)
#   spec_compare  off / n-gram / suffix per workload and batch on the real model (spec_decode, compare part)
#   spec_load     n-gram under load on dummy Llama-3-8B and the idle speculator's cost (spec_decode_load)
#   kernels       attention microbenchmark (and decode with one TP rank's heads), decode split-K, the prefill
#                 attention launch configs, the cost of a kernel boundary (launch_chain)
#   gemm          the int4 and W8A8 tile sweeps at M = 1 and the int4 sweep at W1 sizes
#   tune          one-row int4 GEMV tiles searched in the whole decode step ($OUT/configs/<device>.json, the file
#                 minivllm/kernels/configs/ ships), the Gluon GEMV tiles timed cold, PDL on/off
# spec, quality and quality-int4 need the default model's GGUF (bench/gpu_setup.sh). Every step runs under a hard
# `timeout` (a hang costs that step's limit; the suite goes on); its log is $LOGS/<step>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n "2,$(( $(grep -n "^set -uo" "$0" | cut -d: -f1) - 1 ))p" "$0"; exit 2; }
source bench/gpu_setup.sh
OUT=${OUT:-bench/results}; LOGS=${LOGS:-/tmp/minivllm_logs}; mkdir -p "$OUT" "$LOGS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
GPU=$(python3 -c "import torch; from bench.common import device_slug; print(device_slug(torch.cuda.get_device_name()))")
step() {  # step NAME SECONDS CMD...: CMD under a wall-clock limit, logged to $LOGS/NAME.log; prints tail and status
  local name=$1 limit=$2; shift 2; echo "== $name (limit ${limit}s): $*"
  timeout -k 20 "$limit" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
  tail -n "${TAIL:-8}" "$LOGS/$name.log"; echo "== $name: exit $rc"; }
renamed() { [ -f "$1" ] && mv "$1" "$2"; }   # a part kept under its own name: spec_decode_load_<gpu>.json, ...
gpu_tests() { local name=$1 limit=$2; shift 2; step "tests_$name" "$limit" python3 -m pytest -q -m gpu "$@"; }

run_suite() {
  case "$1" in
  regression)
    gpu_tests regression 400 tests/test_kernels.py tests/test_gpu_engine.py tests/test_argmax.py tests/test_pdl.py \
      tests/test_prefill_attention_sm90.py tests/test_dense_gemv.py -k "not default"
    step throughput_w1 200 python3 bench/throughput.py --skip-peer --out "$OUT"
    step serve 300 python3 bench/serve.py --model llama-3-8b --load-format dummy --concurrency 1,4,16,64 \
      --input-len 512 --output-len 256 --tag "$GPU" --out "$OUT" ;;
  spec)
    gpu_tests spec 150 tests/test_spec_decode_gpu.py
    gpu_tests default_model 400 tests/test_gpu_engine.py tests/test_quant_gguf.py -k "default or gguf"
    step spec_decode 480 python3 bench/spec_decode.py --parts real --draft-layers 8 --ngram-fixed-k 5 --ngram-max-k 7 \
      --warmup-rounds 1 --rounds 5 --out "$OUT"
    for part in load steps verify; do
      extra=(); [ $part = steps ] && extra=(--trace)
      step "spec_decode_$part" 240 python3 bench/spec_decode.py --parts $part "${extra[@]}" --out "$LOGS/$part"
      renamed "$LOGS/$part/spec_decode_$GPU.json" "$OUT/spec_decode_${part}_$GPU.json"
    done ;;
  quant)
    gpu_tests quant 300 tests/test_quant_kernels.py tests/test_quant_w8a8.py tests/test_quant_formats.py \
      tests/test_kv_cache_fp8.py
    step quant 480 python3 bench/quant_bench.py --formats bf16,fp8,int4,int4-asym --out "$OUT"
    step quant_lmhead_fp8kv 360 python3 bench/quant_bench.py --skip-gemm --formats bf16,int4,int4-lmhead,fp8kv \
      --out "$LOGS/formats"
    renamed "$LOGS/formats/quant_$GPU.json" "$OUT/quant_lmhead_fp8kv_$GPU.json"
    step quant_70b 400 python3 bench/quant_bench.py --model llama-3-70b --formats int4,fp8 --skip-gemm \
      --gpu-memory-utilization 0.95 --out "$OUT" ;;
  quality|quality-int4)
    local Q=/tmp/quality T=.carry/p; mkdir -p $Q   # quantized folders are made on this host from calib.txt
    local ppl=(python3 bench/perplexity.py --text $T/heldout.txt --max-tokens 100000 --window 1024 --stride 512
               --dtype bfloat16 --name "quant_quality_$GPU.json" --out "$OUT")
    local quantize=(python3 -m minivllm.cli quantize --calib $T/calib.txt)
    row() { local name=$1 dir=$Q/$2 limit=$3; shift 3   # NAME FOLDER LIMIT QUANTIZE-ARGS: quantize, append its row
      step "quantize_$name" "$limit" "${quantize[@]}" "$@" --out "$dir"
      [ -f "$dir/config.json" ] && step "ppl_$name" 150 "${ppl[@]}" --append --variant "$name=$dir"; }
    if [ "$1" = quality ]; then
      step ppl_baseline 200 "${ppl[@]}" --variant bf16= --variant gguf-q4_1=:gguf --variant fp8=:fp8 --variant int8=:int8
      row int8-smoothquant-0.65 int8sq 60 --method rtn --w8a8 int8 --smoothquant-alpha 0.65
      row fp8-gptq fp8gptq 120 --method gptq --desc-act --w8a8 fp8
      row int4-rtn-g32 rtn32 60 --method rtn --no-sym --group-size 32
      row int4-gptq-g32 gptq32 150 --method gptq --no-sym --desc-act --group-size 32
    else  # appends to the file `quality` wrote (taken from bench/results when $OUT has none)
      [ -f "$OUT/quant_quality_$GPU.json" ] || cp "bench/results/quant_quality_$GPU.json" "$OUT/"
      row int4-awq-g32 awq32 200 --method awq --group-size 32
      for g in 32 128; do
        row int4-gptq-g$g-sequential-fp-target gptaq$g 150 --method gptq --no-sym --desc-act --group-size $g \
          --sequential --target-full-precision
      done
    fi ;;
  models)
    gpu_tests models 300 tests/test_models_families.py tests/test_models_moe_kernel.py
    step models 540 python3 bench/models_bench.py --models qwen3-30b-a3b,mixtral-8x7b,gpt2-xl --out "$OUT"
    step moe_gemv_sweep 200 python3 bench/kernels/moe_gemv_sweep.py --out "$OUT"
    step models_fp8 480 python3 bench/models_bench.py --models qwen3-30b-a3b,mixtral-8x7b --quantization fp8 \
      --skip-kernel --out "$LOGS/fp8"
    renamed "$LOGS/fp8/models_$GPU.json" "$OUT/models_fp8_$GPU.json" ;;
  lora)
    gpu_tests lora 240 tests/test_lora.py tests/test_lora_kernels.py
    step lora_kernels 150 python3 bench/kernels/lora_kernels.py --out "$OUT"
    step lora 330 python3 bench/lora_bench.py --out "$OUT" ;;
  imports)
    python3 -X importtime -c 'import minivllm.server.api_server, minivllm.engine.llm_engine' 2> "$LOGS/importtime.log"
    echo "== slowest imports (cumulative us, module)"; sort -t'|' -k2 -n "$LOGS/importtime.log" | tail -n 40 ;;
  features)
    gpu_tests features 300 tests/test_structured_output.py tests/test_structured_spec_decode.py tests/test_swap.py
    step structured 300 python3 bench/structured_bench.py --out "$OUT"
    step swap 420 python3 bench/swap_bench.py --out "$OUT" ;;
  soak)
    step soak 420 python3 bench/soak.py --model llama-3-8b --load-format dummy --clients 256 --duration-s 300 \
      --max-model-len 2048 --max-tokens 256 --token-id-prompts --server-args "--num-gpu-blocks-override 1024" \
      --tag "$GPU" --out "$OUT"
    step dashboard_cost 300 python3 bench/dashboard_cost.py --model llama-3-8b --load-format dummy --repeats 3 \
      --tag "$GPU" --out "$OUT" ;;
  latency)
    local itl_ms=${ITL_MS:-20}   # the target under test (ITL_MS=... to try another)
    step serve_goodput 540 python3 bench/serve.py --model llama-3-8b --load-format dummy \
      --request-rate 4,8,12,16,20,24,28,32,36,40,44,48,56 --num-prompts 150 --input-len 512 --output-len 256 \
      --server-args "--max-itl-ms $itl_ms" --baseline-server-args "" --merge --tag "$GPU" --out "$OUT"
    step cold_start 200 python3 bench/cold_start.py --model llama-3-8b --load-format dummy --out "$OUT" \
      --merge-into "$OUT/serve_$GPU.json"
    step safetensors_load 150 python3 bench/safetensors_load.py --model llama-3-8b --out "$OUT" \
      --merge-into "$OUT/serve_$GPU.json" ;;
  tp_faults) gpu_tests tp_faults 400 tests/test_tp.py -v -k "not default_model" ;;
  tp_default) gpu_tests tp_default 240 tests/test_tp.py -k default_model ;;
  tp4) step tp4 420 python3 bench/tp_bench.py --skip-8b --big-tp 4 --out "$OUT" ;;
  w1) step throughput_w1 240 python3 bench/throughput.py --skip-peer --out "$OUT" ;;
  spec_tests) gpu_tests spec 240 tests/test_spec_decode_gpu.py ;;
  spec_compare) step spec_decode 330 python3 bench/spec_decode.py --parts compare --out "$OUT" ;;
  spec_load)
    step spec_decode_load 330 python3 bench/spec_decode.py --parts load,idle --out "$LOGS/load"
    renamed "$LOGS/load/spec_decode_$GPU.json" "$OUT/spec_decode_load_$GPU.json" ;;
  parallel)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
    gpu_tests parallel 300 tests/test_tp.py
    step tp 540 python3 bench/tp_bench.py --out "$OUT" ;;
  kernels)
    step attention_bench 200 python3 bench/kernels/attention_bench.py --no-flex --out "$OUT"
    step attention_bench_tp 120 python3 bench/kernels/attention_bench.py --no-flex --tp-ranks 1,2,4 --out "$OUT"
    step decode_split 180 python3 bench/kernels/decode_split_sweep.py --out "$OUT"
    step prefill_sm90_sweep 200 python3 bench/kernels/prefill_sm90_sweep.py --out "$OUT"
    step prefill_attention_sweep 200 python3 bench/kernels/prefill_attention_sweep.py --out "$OUT"
    step launch_chain 120 python3 bench/kernels/launch_chain.py --out "$OUT" ;;
  gemm)
    step int4_gemv_sweep 330 python3 bench/kernels/int4_gemv_sweep.py --ms 1 --out "$OUT"
    step w8a8_tile_sweep 240 python3 bench/kernels/w8a8_tile_sweep.py --ms 1 --out "$OUT"
    step int4_w1_sweep 480 python3 bench/kernels/int4_w1_sweep.py --jobs 15 --large-ms 4096 --out "$OUT" ;;
  tune)
    step step_tile_search 480 python3 bench/kernels/step_tile_search.py --passes 2 --out "$OUT" --write-configs "$OUT/configs"
    step rows_tile_search 480 python3 bench/kernels/rows_tile_search.py --out "$OUT" --write-configs "$OUT/configs"
    step gemv_cold_sweep 330 python3 bench/kernels/gemv_cold_sweep.py --no-narrow --tma-sweep half --out "$OUT"
    step pdl 400 python3 bench/kernels/pdl_bench.py --formats bf16,fp8,int4 --settings 1,2,0 --rounds 2 --w1 --out "$OUT" ;;
  *) echo "unknown suite '$1' (see the list at the top of $0)" >&2; return 2 ;;
  esac
}

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
pids=(); fanned=()
for suite in "$@"; do
  if [[ $suite == *@* ]]; then   # on its own GPUs, in the background
    name=${suite%@*}; mkdir -p "$LOGS/$name"
    (export CUDA_VISIBLE_DEVICES=${suite#*@} LOGS="$LOGS/$name"; run_suite "$name") > "$LOGS/$name.out" 2>&1 &
    pids+=($!); fanned+=("$name")
  else
    run_suite "$suite"
  fi
done
for pid in "${pids[@]}"; do wait "$pid"; done
for name in "${fanned[@]}"; do echo "==== $name"; cat "$LOGS/$name.out"; done
mv -f "$OUT"/*server.log "$LOGS"/ 2>/dev/null   # server logs: not results
