"""Executors: who runs the model for the engine.

With `tensor_parallel_size == 1` the executor is the `ModelRunner` itself. With N > 1,
`MultiprocTPExecutor` is rank 0 of an N-rank group: it starts N - 1 worker processes the way torchrun
would (env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK;
`python -m minivllm.worker.executor_worker`), or, when torchrun started every rank (one per GPU, on one
host or several), joins the group torchrun set up and leaves ranks > 0 to `run_worker`. It wraps the
driver's own runner, whose `step_broadcaster` ships every step to the workers: one pickled header over
the gloo group (shapes, host lists, blocks to copy, prompt-logprob rows) and one int64 tensor over the
device group holding all of the step's input arrays. Workers run the same forward on their shards; the
driver gathers the logits and samples alone. The input tensor is sent after the driver filled in the
tokens still being sampled on the device, on the device's stream, so async scheduling keeps overlapping
host and device work.

Nothing waits forever. A watchdog thread fails the group when a local worker process exits, or when a
step launched `distributed_timeout_s` ago has not finished (it then names the ranks whose reported step
count is behind the driver's); failing aborts the NCCL communicators, which makes every queued or blocked
collective return (on its own thread: it completes once shutdown has dropped the CUDA graphs holding the
communicator), and kills the local workers, which unblocks gloo. The step then raises
`WorkerFailedError`, which stops the engine loop (the server's /health turns 503, requests get 503). When
idle the driver pings the workers, so their wait for the next step has a deadline too. Shutting down
never waits on a peer (see `destroy_distributed`).
"""
from __future__ import annotations

import atexit
import collections
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
from minivllm.distributed import (abort_distributed, attention_head_partition, broadcast_object, broadcast_tensor,
                                  destroy_distributed, init_distributed, launched_by_torchrun, progress_of_ranks,
                                  set_collective_timeout)
from minivllm.models.loader import ModelSource
from minivllm.worker.executor_worker import STARTUP_TIMEOUT_S, run_worker, step_tensors
from minivllm.worker.inputs import ModelInputs
from minivllm.worker.model_runner import ModelRunner, resolve_device

logger = logging.getLogger(__name__)


def create_executor(config: EngineConfig, source: ModelSource, max_num_batched_tokens: int):
    """The object the engine calls `execute_async` / `capture_cuda_graphs` on. Under torchrun, ranks > 0
    serve the driver's steps here and end the process when it stops (`SystemExit(0)`)."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, source, max_num_batched_tokens)
    if launched_by_torchrun() and int(os.environ["RANK"]) > 0:
        _check_torchrun_world(config.tensor_parallel_size)
        run_worker(config, max_num_batched_tokens, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        raise SystemExit(0)
    return MultiprocTPExecutor(config, source, max_num_batched_tokens)


def _check_torchrun_world(tensor_parallel_size: int) -> None:
    if int(os.environ["WORLD_SIZE"]) != tensor_parallel_size:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes, but tensor_parallel_size is "
                         f"{tensor_parallel_size}: start one process per tensor-parallel rank")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died, raised or stalled; the engine cannot continue."""


class MultiprocTPExecutor:
    """Rank 0 of a tensor-parallel group: starts (or joins) the workers, watches them, and forwards
    everything else to its runner."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_num_batched_tokens: int) -> None:
        import torch.distributed as dist
        n = config.tensor_parallel_size
        hf = source.hf_config
        heads = hf.num_attention_heads
        for rank in range(n):  # a bad split is a ValueError here, before any process starts
            attention_head_partition(heads, getattr(hf, "num_key_value_heads", None) or heads, rank, n)
        device = resolve_device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < n and not launched_by_torchrun():
            raise ValueError(f"tensor_parallel_size {n} needs {n} GPUs, {torch.cuda.device_count()} visible")
        if dist.is_initialized():
            raise ValueError("this process already belongs to a torch.distributed group: one tensor-parallel "
                             "engine per process")
        self.timeout_s = config.distributed_timeout_s
        self.workers: dict[int, subprocess.Popen] = {}   # rank -> process, for the ranks started here
        self._lock = threading.Lock()          # one message at a time, in the same order on every rank
        self._in_flight: collections.deque[float] = collections.deque()   # launch times of unread steps
        self._steps_sent = 0
        self._last_message = time.monotonic()
        self._error: WorkerFailedError | None = None   # set once the group failed
        self._shut_down = False   # shutdown() began
        self._left = False        # the group is left: nothing to watch
        backend = "nccl" if device.type == "cuda" else "gloo"
        if launched_by_torchrun():
            _check_torchrun_world(n)
        else:
            self._start_workers(config, max_num_batched_tokens, n, device)
        atexit.register(self.shutdown)
        self._watchdog = threading.Thread(target=self._watch, name="minivllm-tp-watchdog", daemon=True)
        self._watchdog.start()
        try:
            init_distributed(0, n, backend, STARTUP_TIMEOUT_S)
            self.driver = ModelRunner(config, source, max_num_batched_tokens)
        except BaseException as e:
            error = self._error or (e if isinstance(e, ValueError) else WorkerFailedError(
                f"tensor-parallel start-up failed: {e!r}"))
            self.shutdown()
            raise error from e
        self.driver.step_broadcaster = self._broadcast_step
        logger.info("tensor parallel: %d ranks over %s", n, backend)

    def _start_workers(self, config: EngineConfig, max_num_batched_tokens: int, n: int,
                       device: torch.device) -> None:
        env = dict(os.environ, MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   MASTER_PORT=str(_free_port()), WORLD_SIZE=str(n))
        os.environ.update(MASTER_ADDR=env["MASTER_ADDR"], MASTER_PORT=env["MASTER_PORT"])
        # Each worker's "cuda" is the GPU of its LOCAL_RANK (set before the model is built).
        worker_config = dataclasses.replace(config, device="cuda") if device.type == "cuda" else config
        config_json = json.dumps(dataclasses.asdict(worker_config))
        for rank in range(1, n):
            self.workers[rank] = subprocess.Popen(
                [sys.executable, "-m", "minivllm.worker.executor_worker", config_json, str(max_num_batched_tokens)],
                env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)))

    # ---- messages to the workers ------------------------------------------------------------------------------
    def _send(self, message: tuple, wait: bool = True) -> None:
        """Broadcast `message`. wait=False skips it while another message is being sent: the watchdog's
        pings must never wait behind a send blocked on a lost rank (and that message tells the workers the
        driver is alive anyway)."""
        if not self._lock.acquire(blocking=wait):
            return
        try:
            broadcast_object(message)
            self._last_message = time.monotonic()
        finally:
            self._lock.release()

    def _broadcast_step(self, blocks_to_copy: list[tuple[int, int]], inputs: ModelInputs, prompt_rows) -> None:
        """One step: its header, then all input arrays packed in one int64 tensor."""
        tensors = step_tensors(inputs)
        m = inputs.metadata
        with self._lock:
            self._steps_sent += 1   # counted first: a gloo send to a stalled rank blocks
            broadcast_object(("step", [tuple(t.shape) for t in tensors], m.max_query_len, m.max_seq_len,
                              m.query_start_loc_cpu, m.seq_lens_cpu, blocks_to_copy, prompt_rows))
            broadcast_tensor(torch.cat([t.reshape(-1).to(torch.int64) for t in tensors]))
            self._last_message = time.monotonic()

    # ---- failure detection ------------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Fail the group when a local worker exits or a step misses its deadline; ping idle workers."""
        while not (self._left or self._error):
            now = time.monotonic()
            try:
                oldest = self._in_flight[0]   # the engine thread appends and pops meanwhile
            except IndexError:
                oldest = None
            dead = [(rank, p.returncode) for rank, p in self.workers.items() if p.poll() is not None]
            if dead and not self._shut_down:
                self._fail("tensor-parallel worker rank %d exited with code %s" % dead[0])
            elif oldest is not None and now - oldest > self.timeout_s:
                self._fail(self._stall_message(now - oldest))
            elif (oldest is None and not self._shut_down and "driver" in self.__dict__
                  and now - self._last_message > self.timeout_s / 4):
                try:
                    self._send(("ping",), wait=False)
                except Exception as e:   # a worker vanished on another host: gloo noticed first
                    self._fail(f"tensor-parallel workers unreachable: {e!r}")
            time.sleep(0.1)

    def _stall_message(self, waited_s: float) -> str:
        try:
            behind = {rank: steps for rank, steps in progress_of_ranks().items() if steps < self._steps_sent}
        except Exception:
            behind = {}
        if behind:
            ranks = ", ".join(f"rank {r} (at step {s})" for r, s in sorted(behind.items()))
            return (f"tensor-parallel step {self._steps_sent} not finished after {waited_s:.0f} s "
                    f"(distributed_timeout_s): stalled: {ranks}")
        return (f"tensor-parallel step not finished after {waited_s:.0f} s (distributed_timeout_s): every rank "
                "launched it, so a device or collective hangs")

    def _fail(self, reason: str) -> None:
        """Record the failure, then unblock everything that waits on a peer."""
        if self._error is not None:
            return
        logger.error("%s", reason)
        self._error = WorkerFailedError(reason)
        for p in self.workers.values():
            if p.poll() is None:
                p.kill()
        abort_distributed()   # returns at once; shutdown() drops the graphs the abort waits for

    def _raise_failure(self, error: BaseException) -> None:
        """A collective failed: raise the watchdog's account of it (which names the rank behind it when a
        local worker died: its next tick notices), else this error."""
        deadline = time.monotonic() + 2
        while self._error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self._fail(f"tensor-parallel step failed: {error!r}")
        raise self._error from error

    # ---- what the engine calls ----------------------------------------------------------------------------------
    def __getattr__(self, name: str):
        return getattr(self.__dict__["driver"], name)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        self._send(("capture", max_num_seqs, max_model_len))
        self.driver.capture_cuda_graphs(max_num_seqs, max_model_len)
        set_collective_timeout(self.timeout_s)   # start-up is over: steps have the short deadline

    def execute(self, scheduler_output, grammar_bitmask=None):
        return self.execute_async(scheduler_output, grammar_bitmask).result()

    def execute_async(self, scheduler_output, grammar_bitmask=None, timed=False, timed_end=False):
        if self._error is not None or self._shut_down:
            raise self._error or WorkerFailedError("the tensor-parallel group is shut down")
        self._in_flight.append(time.monotonic())
        try:
            return _WatchedOutput(self.driver.execute_async(scheduler_output, grammar_bitmask, timed, timed_end), self)
        except Exception as e:
            self._raise_failure(e)

    def shutdown(self) -> None:
        """Tell live workers to stop, then leave the group; waits for no peer (idempotent)."""
        if self._shut_down:
            return
        self._shut_down = True
        atexit.unregister(self.shutdown)
        healthy = self._error is None and "driver" in self.__dict__ and all(
            p.poll() is None for p in self.workers.values())
        if healthy:
            try:
                self._send(("stop",))
            except Exception:
                healthy = False
                logger.warning("could not tell the tensor-parallel workers to stop")
        if "driver" in self.__dict__:   # healthy: the steps still queued finish (the watchdog guards this wait)
            self.driver.release_cuda_graphs(synchronize=healthy)
        self._left = True
        destroy_distributed()
        for p in self.workers.values():
            try:
                p.wait(timeout=30 if healthy else 5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class _WatchedOutput:
    """A pending step of the group: reading it ends its deadline, and fails if the group failed meanwhile."""

    def __init__(self, pending, executor: MultiprocTPExecutor) -> None:
        self._pending, self._executor = pending, executor

    def __getattr__(self, name: str):
        return getattr(self._pending, name)

    def result(self):
        executor = self._executor
        try:
            # Polled rather than a blocking sync: a step whose collective waits on a lost peer may never
            # finish on the device, and the engine must still get the watchdog's error.
            while not self._pending.done():
                if executor._error is not None:
                    raise executor._error
                time.sleep(0)   # lets the server's threads run
            try:
                output = self._pending.result()
            except Exception as e:
                executor._raise_failure(e)
        finally:
            executor._in_flight.popleft()
        if executor._error is not None:
            raise executor._error
        return output
