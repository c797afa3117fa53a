"""A tensor-parallel worker process (rank > 0): load this rank's shard, then run every step the driver
broadcasts until told to stop.

Started by `MultiprocTPExecutor` as `python -m minivllm.worker.executor_worker CONFIG_JSON MAX_TOKENS`
with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so the same
command runs on another host. Any exception ends the process with a non-zero code: the driver's
collectives then fail instead of waiting forever. `MINIVLLM_TP_FAIL_AT_STEP=k` (tests only) makes the
worker raise at its k-th step, the way a real fault inside a forward pass would.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys

import torch

from minivllm.attention.metadata import set_forward_context
from minivllm.config import EngineConfig
from minivllm.distributed import broadcast_object, destroy_distributed, init_distributed
from minivllm.models.loader import resolve_model
from minivllm.worker.executor import collective_timeout_s, receive_step
from minivllm.worker.model_runner import ModelRunner, resolve_device

logger = logging.getLogger("minivllm.worker")


@torch.inference_mode()
def run_step(runner: ModelRunner, header: tuple) -> None:
    blocks_to_copy, inputs = receive_step(header, runner.device)
    if blocks_to_copy:
        runner._copy_blocks(blocks_to_copy)
    hidden, _ = runner._forward(inputs)   # no logits from graphs under tensor parallelism
    if inputs.logits_indices.numel():
        runner.model.compute_logits(hidden[inputs.logits_indices])  # this rank's part of the gather


def serve(runner: ModelRunner) -> None:
    fail_at = int(os.environ.get("MINIVLLM_TP_FAIL_AT_STEP", "0"))
    steps = 0
    while True:
        message = broadcast_object()
        if message[0] == "stop":
            return
        if message[0] == "capture":
            runner.capture_cuda_graphs(*message[1:])
            continue
        steps += 1
        if steps == fail_at:
            raise RuntimeError(f"injected fault at step {steps} (MINIVLLM_TP_FAIL_AT_STEP)")
        run_step(runner, message)


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s rank %(process)d %(name)s: "
                        "%(message)s")
    # Ctrl-C reaches the whole process group; the driver decides when workers stop (its "stop" message).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = EngineConfig(**json.loads(argv[0]))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if resolve_device(config.device).type == "cuda" else "gloo"
    init_distributed(rank, world_size, backend, collective_timeout_s())
    try:
        runner = ModelRunner(config, resolve_model(config.model, config.load_format), int(argv[1]))
        serve(runner)
    except Exception:
        logger.exception("tensor-parallel worker rank %d failed", rank)
        os._exit(1)   # skip destructors that might wait on a peer: the driver must see this rank gone
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
