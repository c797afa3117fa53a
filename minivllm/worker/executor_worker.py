"""A tensor-parallel worker (rank > 0): load this rank's shard, then run every step the driver broadcasts
until told to stop.

Started by `MultiprocTPExecutor` as `python -m minivllm.worker.executor_worker CONFIG_JSON MAX_TOKENS` with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or by torchrun itself
(`run_worker`, from `create_executor` on ranks > 0), so the same code runs on another host. Any exception
ends the process with a non-zero code: the driver's collectives then fail instead of waiting. After each
step the worker reports its step count to the rendezvous store, which lets the driver name a stalled rank.

`MINIVLLM_TP_INJECT_FAULT=KIND:STEP` (tests only) makes the worker misbehave at its STEP-th step the way a
real fault would: `raise` (an exception in the forward pass), `exit` (the process dies) or `stall` (the
rank stops answering without dying).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.config import EngineConfig
from minivllm.distributed import (broadcast_object, broadcast_tensor, destroy_distributed, init_distributed,
                                  report_progress, set_collective_timeout)
from minivllm.models.loader import resolve_model
from minivllm.worker.inputs import ModelInputs
from minivllm.worker.model_runner import ModelRunner, resolve_device
from minivllm.worker.prompt_logprobs import compute_prompt_logits

logger = logging.getLogger("minivllm.worker")

# Start-up (weights loaded, KV cache sized, graphs captured) may take far longer than a step.
STARTUP_TIMEOUT_S = 1800.0
FAULT_ENV = "MINIVLLM_TP_INJECT_FAULT"


def step_tensors(inputs: ModelInputs) -> list[torch.Tensor]:
    """The step's input arrays in the order both sides pack them."""
    m = inputs.metadata
    return [inputs.input_ids, inputs.positions, m.slot_mapping, inputs.logits_indices, m.query_start_loc,
            m.seq_lens, m.block_tables]


def receive_step(header: tuple, device: torch.device) -> tuple[list[tuple[int, int]], ModelInputs, list | None]:
    """Rebuild the driver's ModelInputs from the step message (sampling rows stay with the driver); also
    the blocks to copy and the rows whose prompt logprobs the driver computes."""
    _, shapes, max_query_len, max_seq_len, qsl_cpu, seq_lens_cpu, blocks_to_copy, prompt_rows = header
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    flat = broadcast_tensor(torch.empty(sum(sizes), dtype=torch.int64, device=device))
    ids, positions, slots, logits_indices, qsl, seq_lens, block_tables = (
        t.view(s) for t, s in zip(flat.split(sizes), shapes))
    metadata = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl.to(torch.int32),
                                 seq_lens=seq_lens.to(torch.int32), block_tables=block_tables.to(torch.int32),
                                 max_query_len=max_query_len, max_seq_len=max_seq_len,
                                 query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu)
    return blocks_to_copy, ModelInputs(ids, positions, metadata, logits_indices=logits_indices), prompt_rows


@torch.inference_mode()
def run_step(runner: ModelRunner, header: tuple) -> None:
    """This rank's share of one step: the forward pass and its parts of the driver's logits gathers, in the
    driver's order (prompt rows first, then the sampled rows)."""
    blocks_to_copy, inputs, prompt_rows = receive_step(header, runner.device)
    if blocks_to_copy:
        runner._copy_blocks(blocks_to_copy)
    hidden, _ = runner._forward(inputs)   # no logits from graphs under tensor parallelism
    if prompt_rows is not None:
        for _ in compute_prompt_logits(runner.model.compute_logits, hidden, prompt_rows):
            pass
    if inputs.logits_indices.numel():
        runner.model.compute_logits(hidden[inputs.logits_indices])


def _injected_fault() -> tuple[str | None, int]:
    kind, _, step = os.environ.get(FAULT_ENV, "").partition(":")
    if kind and kind not in ("raise", "exit", "stall"):
        raise ValueError(f"{FAULT_ENV}: unknown fault {kind!r} (raise, exit or stall)")
    return (kind or None), int(step or 0)


def serve(runner: ModelRunner, step_timeout_s: float) -> None:
    fault, fault_step = _injected_fault()
    steps = 0
    while True:
        message = broadcast_object()
        kind = message[0]
        if kind == "stop":
            return
        if kind == "ping":   # the driver is idle; it is alive
            continue
        if kind == "capture":
            runner.capture_cuda_graphs(*message[1:])
            set_collective_timeout(step_timeout_s)   # start-up is over: steps have the short deadline
            continue
        steps += 1
        if fault is not None and steps == fault_step:
            logger.error("injected fault %r at step %d (%s)", fault, steps, FAULT_ENV)
            if fault == "raise":
                raise RuntimeError(f"injected fault at step {steps} ({FAULT_ENV})")
            if fault == "exit":
                os._exit(3)
            time.sleep(10 ** 6)
        run_step(runner, message)
        report_progress(steps)


def run_worker(config: EngineConfig, max_num_batched_tokens: int, rank: int, world_size: int) -> None:
    """Join the group as `rank`, serve steps until the driver says stop, leave the group. A failure ends
    the process at once (`os._exit`): destructors could wait on a peer, and the driver must see this rank
    gone."""
    backend = "nccl" if resolve_device(config.device).type == "cuda" else "gloo"
    init_distributed(rank, world_size, backend, STARTUP_TIMEOUT_S)
    try:
        runner = ModelRunner(config, resolve_model(config.model, config.load_format), max_num_batched_tokens)
        serve(runner, config.distributed_timeout_s)
        runner.release_cuda_graphs()
    except Exception:
        logger.exception("tensor-parallel worker rank %d failed", rank)
        os._exit(1)
    destroy_distributed()


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s rank %(process)d %(name)s: "
                        "%(message)s")
    # Ctrl-C reaches the whole process group; the driver decides when workers stop (its "stop" message).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = EngineConfig(**json.loads(argv[0]))
    run_worker(config, int(argv[1]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main(sys.argv[1:])
