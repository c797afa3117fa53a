"""Executors: who runs the model for the engine.

With `tensor_parallel_size == 1` the executor is the `ModelRunner` itself. With N > 1,
`MultiprocTPExecutor` starts N - 1 worker processes the way torchrun would (env:// rendezvous:
MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK; `python -m minivllm.worker.executor_worker`),
joins them as rank 0 and wraps the driver's own runner, whose `step_broadcaster` ships every step to
the workers: one pickled header over the gloo group (shapes, host lists, blocks to copy) and one
int64 tensor over the device group holding all of the step's input arrays. Workers run the same
forward on their shards; the driver gathers the logits and samples alone. The input tensor is sent
after the driver filled in the tokens still being sampled on the device, on the device's stream, so
async scheduling keeps overlapping host and device work.

Failure: a worker that raises exits; the driver's next collective then fails (gloo sees the closed
connection; any backend gives up after `MINIVLLM_TP_TIMEOUT_S`) and the step raises an error naming
the rank, which stops the engine loop (the server's /health then fails, requests get 503).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import torch

from minivllm.config import EngineConfig
from minivllm.distributed import (attention_head_partition, broadcast_object, broadcast_tensor,
                                  destroy_distributed, init_distributed)
from minivllm.models.loader import ModelSource
from minivllm.worker.inputs import ModelInputs
from minivllm.worker.model_runner import ModelRunner, resolve_device

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "MINIVLLM_TP_TIMEOUT_S"


def collective_timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, "600"))


def create_executor(config: EngineConfig, source: ModelSource, max_num_batched_tokens: int):
    """The object the engine calls `execute_async` / `capture_cuda_graphs` on."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, source, max_num_batched_tokens)
    return MultiprocTPExecutor(config, source, max_num_batched_tokens)


# ---- the step message: what the driver broadcasts each step -----------------------------------------------
def _step_tensors(inputs: ModelInputs) -> list[torch.Tensor]:
    m = inputs.metadata
    return [inputs.input_ids, inputs.positions, m.slot_mapping, inputs.logits_indices, m.query_start_loc,
            m.seq_lens, m.block_tables]


def broadcast_step(blocks_to_copy: list[tuple[int, int]], inputs: ModelInputs) -> None:
    """Driver side of one step: header, then all input arrays packed in one int64 tensor."""
    tensors = _step_tensors(inputs)
    m = inputs.metadata
    broadcast_object(("step", [tuple(t.shape) for t in tensors], m.max_query_len, m.max_seq_len,
                      m.query_start_loc_cpu, m.seq_lens_cpu, blocks_to_copy))
    broadcast_tensor(torch.cat([t.reshape(-1).to(torch.int64) for t in tensors]))


def receive_step(header: tuple, device: torch.device) -> tuple[list[tuple[int, int]], ModelInputs]:
    """Worker side: rebuild the driver's ModelInputs (sampling rows stay with the driver)."""
    from minivllm.attention.metadata import AttentionMetadata
    _, shapes, max_query_len, max_seq_len, qsl_cpu, seq_lens_cpu, blocks_to_copy = header
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    flat = broadcast_tensor(torch.empty(sum(sizes), dtype=torch.int64, device=device))
    ids, positions, slots, logits_indices, qsl, seq_lens, block_tables = (
        t.view(s) for t, s in zip(flat.split(sizes), shapes))
    metadata = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl.to(torch.int32),
                                 seq_lens=seq_lens.to(torch.int32), block_tables=block_tables.to(torch.int32),
                                 max_query_len=max_query_len, max_seq_len=max_seq_len,
                                 query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu)
    return blocks_to_copy, ModelInputs(ids, positions, metadata, logits_indices, [], {})


# ---- the driver ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died or a collective with it failed; the engine cannot continue."""


class MultiprocTPExecutor:
    """Rank 0 of a tensor-parallel group: starts the workers and forwards everything else to its runner."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_num_batched_tokens: int) -> None:
        import torch.distributed as dist
        n = config.tensor_parallel_size
        if n < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {n}")
        hf = source.hf_config
        heads = hf.num_attention_heads
        for rank in range(n):  # a bad split is a ValueError here, before any process starts
            attention_head_partition(heads, getattr(hf, "num_key_value_heads", None) or heads, rank, n)
        device = resolve_device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < n:
            raise ValueError(f"tensor_parallel_size {n} needs {n} GPUs, {torch.cuda.device_count()} visible")
        if dist.is_initialized():
            raise ValueError("this process already belongs to a torch.distributed group: one tensor-parallel "
                             "engine per process")
        backend = "nccl" if device.type == "cuda" else "gloo"
        env = dict(os.environ, MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   MASTER_PORT=str(_free_port()), WORLD_SIZE=str(n))
        os.environ.update(MASTER_ADDR=env["MASTER_ADDR"], MASTER_PORT=env["MASTER_PORT"])
        # Each worker's "cuda" is the GPU of its LOCAL_RANK (set before the model is built).
        worker_config = dataclasses.replace(config, device="cuda") if device.type == "cuda" else config
        config_json = json.dumps(dataclasses.asdict(worker_config))
        self.workers = [subprocess.Popen(
            [sys.executable, "-m", "minivllm.worker.executor_worker", config_json, str(max_num_batched_tokens)],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))) for rank in range(1, n)]
        self._closed = False     # the group can no longer run a step
        self._shut_down = False  # shutdown() was called
        atexit.register(self.shutdown)
        try:
            init_distributed(0, n, backend, collective_timeout_s())
            self.driver = ModelRunner(config, source, max_num_batched_tokens)
        except BaseException as e:
            error = self._failure(e)
            self.shutdown()
            raise error from e
        self.driver.step_broadcaster = broadcast_step
        self._backend = backend
        threading.Thread(target=self._watch_workers, name="minivllm-tp-watchdog", daemon=True).start()
        logger.info("tensor parallel: %d ranks over %s", n, backend)

    def _watch_workers(self) -> None:
        """A worker that exits unasked leaves the driver's next (or current) collective without a peer. gloo
        notices the closed connection; NCCL would wait out the timeout, so its group is aborted, which makes
        the blocked collective raise now."""
        while not (self._closed or self._shut_down):
            dead = [(rank, p.returncode) for rank, p in enumerate(self.workers, 1) if p.poll() is not None]
            if dead and not (self._closed or self._shut_down):
                logger.error("tensor-parallel worker rank %d exited with code %s", *dead[0])
                self._closed = True
                if self._backend == "nccl":
                    with contextlib.suppress(Exception):
                        torch.distributed.distributed_c10d._abort_process_group()
                return
            time.sleep(0.5)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["driver"], name)

    def _failure(self, error: BaseException) -> BaseException:
        """Name the rank that died, if one did (give it a moment to exit)."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            dead = [(rank, p.returncode) for rank, p in enumerate(self.workers, 1) if p.poll() is not None]
            if dead:
                rank, code = dead[0]
                return WorkerFailedError(f"tensor-parallel worker rank {rank} exited with code {code}: {error}")
            if not isinstance(error, (RuntimeError, torch.distributed.DistBackendError)):
                break
            time.sleep(0.1)
        return error if isinstance(error, ValueError) else WorkerFailedError(
            f"tensor-parallel step failed: {error!r}")

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        broadcast_object(("capture", max_num_seqs, max_model_len))
        self.driver.capture_cuda_graphs(max_num_seqs, max_model_len)

    def execute(self, scheduler_output, grammar_bitmask=None):
        return self.execute_async(scheduler_output, grammar_bitmask).result()

    def execute_async(self, scheduler_output, grammar_bitmask=None, timed=False):
        if self._closed:
            raise self._failure(WorkerFailedError("the tensor-parallel group is shut down"))
        try:
            return self.driver.execute_async(scheduler_output, grammar_bitmask, timed)
        except Exception as e:
            self._closed = True   # a failed collective leaves the group unusable
            raise self._failure(e) from e

    def shutdown(self) -> None:
        """Tell live workers to stop, then leave the group (idempotent)."""
        if self._shut_down:
            return
        self._shut_down = True
        atexit.unregister(self.shutdown)
        clean = not self._closed and all(p.poll() is None for p in self.workers) and "driver" in self.__dict__
        if clean:
            try:
                broadcast_object(("stop",))
            except Exception:
                clean = False
                logger.warning("could not tell the tensor-parallel workers to stop")
        self._closed = True
        for p in self.workers:
            try:
                p.wait(timeout=30 if clean else 5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        destroy_distributed()
