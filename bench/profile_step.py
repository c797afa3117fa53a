"""Where does one engine step spend its time? Times each phase of `LLMEngine.step()` (schedule, input
preparation, forward, logits + sampling, update, outputs) with a device sync between phases, for decode
steps at a few batch sizes. The phases run one after another here; in the engine, async scheduling
overlaps the host phases of one step with the device work of the previous one.

`--trace` instead runs a whole workload (W1 by default) through the real engine loop, unchanged, and
records per step: the host time to launch it, the time the host waits for its result, and from CUDA
events around each launch the device time of the step and how long the device sat idle before it.

  python bench/profile_step.py --model llama-3-8b --batch 1,64 [--device cpu] [--out DIR]
  python bench/profile_step.py --model llama-3-8b --trace 64x512x256 [--max-num-batched-tokens 8192]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import run_metadata, write_json  # noqa: E402
from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.worker.inputs import prepare_inputs, prepare_sampling  # noqa: E402

PHASES = ("schedule", "prepare_inputs", "forward", "sample", "update", "outputs")


def profile_decode(llm: LLM, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    engine = llm.llm_engine
    runner = engine.runner
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", torch.randint(0, 1000, (prompt_len,)).tolist(), params)
    while any(s.num_computed_tokens < s.num_tokens - 1 or s.num_output_tokens == 0
              for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill until every sequence decodes
    if engine._in_flight is not None:  # phases are timed one after another below, not overlapped
        engine._complete_in_flight()
    times = {p: [] for p in PHASES}
    for _ in range(steps):
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        t1 = time.perf_counter()
        inputs = prepare_inputs(out, runner.block_size, runner.stager)
        prepare_sampling(inputs, out, runner.sampling_stager)
        sync()
        t2 = time.perf_counter()
        hidden, _ = runner._forward(inputs)
        sync()
        t3 = time.perf_counter()
        from minivllm.core.interfaces import ModelOutput
        from minivllm.layers.sampler import SamplingMetadata
        logits = runner.model.compute_logits(hidden[inputs.logits_indices])
        sampled = runner.sampler(logits, SamplingMetadata.build(inputs.sampling_rows, runner.vocab_size,
                                                                runner.device)).token_ids.tolist()
        t4 = time.perf_counter()
        groups = engine.scheduler.update(out, ModelOutput(sampled_token_ids=[[t] for t in sampled]))
        t5 = time.perf_counter()
        [engine._make_output(g) for g in groups]
        t6 = time.perf_counter()
        for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
            times[phase].append(dt * 1e3)
    engine.abort_request([f"p{batch}-{i}" for i in range(batch)])
    medians = {p: statistics.median(v) for p, v in times.items()}
    medians["total"] = sum(medians.values())
    return medians


def kernel_table(llm: LLM, prompt_len: int, batch: int) -> dict:
    """torch.profiler's CUDA kernels for one prefill step of `batch` prompts and 10 decode steps: printed
    (top 40 by time) and returned per decode step, each kernel's name with its launches and microseconds."""
    from torch.profiler import ProfilerActivity, profile
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    decode: dict = {}
    for warm in (True, False):
        for i in range(batch):
            engine.add_request(f"k{warm}-{i}", torch.randint(0, 1000, (prompt_len,)).tolist(), params)
        if warm:
            while engine.has_unfinished_requests():
                engine.step()
            continue
        for label, steps in (("prefill step", 1), ("10 decode steps", 10)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    out = engine.scheduler.schedule()
                    n_tokens = out.total_num_scheduled_tokens
                    engine.scheduler.update(out, engine.runner.execute(out))
                torch.cuda.synchronize()
            wall_ms = 1e3 * (time.perf_counter() - start)
            print(f"--- {label}: {n_tokens} tokens in the last step, {wall_ms:.1f} ms wall (profiled)")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))
            if steps > 1:
                kernels = [{"name": e.key, "launches_per_step": e.count / steps,
                            "us_per_step": e.self_device_time_total / steps}
                           for e in prof.key_averages() if e.self_device_time_total > 0]
                kernels.sort(key=lambda k: -k["us_per_step"])
                decode = {"batch": batch, "steps": steps, "wall_ms_per_step": wall_ms / steps,
                          "kernel_us_per_step": sum(k["us_per_step"] for k in kernels), "kernels": kernels,
                          "timeline": kernel_timeline(prof)}
            while steps == 1 and engine.scheduler.waiting:  # finish prefill before profiling decode
                out = engine.scheduler.schedule()
                engine.scheduler.update(out, engine.runner.execute(out))
        while engine.has_unfinished_requests():
            engine.step()
    return decode


def kernel_timeline(prof) -> list[list]:
    """Every device activity of a profile in launch order, as [name, start µs from the first, duration µs]:
    which of a step's launches of one kernel (a layer's qkv, o, gate/up or down GEMV) takes how long, and
    the gaps between them."""
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start if events else 0
    return [[e.name[:60], round(e.time_range.start - t0, 2), round(e.time_range.elapsed_us(), 2)] for e in events]


class StepTracer:
    """Wraps the engine's launch and read-back calls (the engine itself is not modified) to record, per
    launched step: scheduled tokens, host time of each part of the launch, host wait time, and CUDA
    events at its start and end. An event reached while the stream is busy completes right after the
    work ahead of it, so `elapsed(end of step k, start of step k+1)` is the time the device idled
    waiting for the host."""

    LAUNCH_PARTS = ("prepare_inputs", "_forward", "compute_logits", "sampler", "_start_copy_to_host")

    def __init__(self, engine) -> None:
        import minivllm.worker.model_runner as runner_module
        from minivllm.worker.model_runner import PendingModelOutput
        self.engine, self.cuda = engine, engine.runner.device.type == "cuda"
        self.steps: list[dict] = []
        self.current: dict | None = None
        runner = engine.runner
        tracer = self
        restores = []

        def wrap(owner, name, key):
            original = getattr(owner, name)

            def timed(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    if tracer.current is not None:
                        tracer.current[key] = tracer.current.get(key, 0.0) + 1e3 * (time.perf_counter() - t0)
            setattr(owner, name, timed)
            restores.append(lambda: setattr(owner, name, original))

        wrap(runner_module, "prepare_inputs", "prepare_ms")
        wrap(runner, "_forward", "forward_launch_ms")
        wrap(runner.model, "compute_logits", "logits_launch_ms")
        wrap(runner.sampler, "forward", "sample_launch_ms")
        wrap(runner, "_start_copy_to_host", "copy_launch_ms")
        launch = runner.execute_async
        result = PendingModelOutput.result

        def traced_launch(scheduler_output, *args):
            decode_only = all(n == 1 for n in scheduler_output.num_scheduled_tokens)
            record = {"tokens": scheduler_output.total_num_scheduled_tokens, "seqs": len(scheduler_output.seqs),
                      "kind": "verify" if scheduler_output.spec_token_ids else "decode" if decode_only else "prefill",
                      "wait_ms": 0.0}
            tracer.current = record
            if tracer.cuda:
                record["start"] = torch.cuda.Event(enable_timing=True)
                record["start"].record()
            t0 = time.perf_counter()
            pending = launch(scheduler_output, *args)
            record["launch_ms"] = 1e3 * (time.perf_counter() - t0)
            tracer.current = None
            if tracer.cuda:
                record["end"] = torch.cuda.Event(enable_timing=True)
                record["end"].record()
            pending._trace_record = record
            tracer.steps.append(record)
            return pending

        def traced_result(pending):
            t0 = time.perf_counter()
            if pending._ready is not None:
                pending._ready.synchronize()
            record = getattr(pending, "_trace_record", None)
            if record is not None:
                record["wait_ms"] = 1e3 * (time.perf_counter() - t0)
            return result(pending)

        step = engine.step

        def traced_step():
            # The whole engine step (scheduling, proposing, reading back, outputs), charged to the step it launched.
            count, t0 = len(tracer.steps), time.perf_counter()
            outputs = step()
            if len(tracer.steps) > count:
                tracer.steps[-1]["engine_step_ms"] = 1e3 * (time.perf_counter() - t0)
            return outputs

        runner.execute_async = traced_launch
        engine.step = traced_step
        PendingModelOutput.result = traced_result
        restores += [lambda: delattr(runner, "execute_async"), lambda: delattr(engine, "step"),
                     lambda: setattr(PendingModelOutput, "result", result)]
        self._restores = restores

    def close(self) -> None:
        for restore in reversed(self._restores):
            restore()

    def summary(self) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
        rows = {"prefill": [], "decode": [], "verify": []}
        for i, step in enumerate(self.steps):
            row = {k: v for k, v in step.items() if k in ("tokens", "seqs") or k.endswith("_ms")}
            if self.cuda:
                row["device_ms"] = step["start"].elapsed_time(step["end"])
                row["idle_before_ms"] = (self.steps[i - 1]["end"].elapsed_time(step["start"]) if i else 0.0)
            rows[step["kind"]].append(row)
        out = {"prefill_rows": rows["prefill"]}
        for kind, items in rows.items():
            if not items:
                continue
            keys = sorted({k for r in items for k in r if k.endswith("_ms")})
            out[kind] = {"steps": len(items), "tokens": sum(r["tokens"] for r in items),
                         **{f"sum_{k}": sum(r.get(k, 0.0) for r in items) for k in keys},
                         **{f"median_{k}": statistics.median(r.get(k, 0.0) for r in items) for k in keys}}
        return out


def trace_workload(llm: LLM, num_requests: int, prompt_len: int, output_len: int, kernels: bool) -> dict:
    """Run the workload through `LLMEngine.step()` as `LLM.generate` does, with a StepTracer attached."""
    engine = llm.llm_engine
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def run(tag: str, n: int, steps_to_profile: tuple[int, int] | None = None):
        generator = torch.Generator().manual_seed(len(tag))
        for i in range(n):
            engine.add_request(f"{tag}-{i}", torch.randint(0, vocab, (prompt_len,), generator=generator).tolist(),
                               params)
        step, prof = 0, None
        while engine.has_unfinished_requests():
            if steps_to_profile and step == steps_to_profile[0]:
                from torch.profiler import ProfilerActivity, profile
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                prof.__enter__()
                torch.cuda.set_sync_debug_mode("warn")  # names any op that waits for the device
                started = time.perf_counter()
            engine.step()
            step += 1
            if prof is not None and step == steps_to_profile[1]:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("default")
                wall = time.perf_counter() - started
                prof.__exit__(None, None, None)
                print(f"--- {tag}: engine steps {steps_to_profile[0]}..{steps_to_profile[1]} (profiled), "
                      f"{1e3 * wall:.1f} ms wall")
                for key in ("self_cuda_time_total", "self_cpu_time_total"):
                    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
                prof = None

    run("warm", min(8, num_requests))
    cuda = engine.runner.device.type == "cuda"
    memory_before = torch.cuda.memory_stats() if cuda else {}
    tracer = StepTracer(engine)
    started = time.perf_counter()
    run("trace", num_requests)
    elapsed = time.perf_counter() - started
    tracer.close()
    result = {"workload": f"{num_requests} x {prompt_len} -> {output_len}", "elapsed_s": elapsed,
              "output_tokens_per_s": num_requests * output_len / elapsed, "steps": tracer.summary()}
    if cuda:
        after = torch.cuda.memory_stats()
        result["allocator"] = {k: after.get(k, 0) - memory_before.get(k, 0)
                               for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")}
    if kernels and cuda:
        run("kernels-first-step", num_requests, steps_to_profile=(0, 1))
        run("kernels-decode", num_requests, steps_to_profile=(output_len // 2, output_len // 2 + 10))
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--kernels", action="store_true", help="also print torch.profiler kernel tables")
    parser.add_argument("--trace", default=None, metavar="NxPxO",
                        help="trace N requests of P prompt tokens -> O output tokens through the engine loop")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--quantization", default=None, help="e.g. fp8, gptq (dummy weights in that format)")
    args = parser.parse_args(argv)
    if args.trace:
        return main_trace(args)
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, device=args.device,
              quantization=args.quantization, max_num_seqs=max(batches), max_model_len=args.prompt_len + args.steps + 64,
              enforce_eager=args.enforce_eager, kv_cache_memory=None if args.device != "cpu" else 256 * 2**20)
    meta = run_metadata(llm.llm_engine.runner.device)
    print(f"step profile | {meta['device']} | commit {meta['commit']} | {args.model} | "
          f"quantization={args.quantization} | eager={args.enforce_eager}")
    rows = {}
    print(f"{'batch':>6} " + " ".join(f"{p:>15}" for p in PHASES) + f" {'total ms':>9}")
    for batch in batches:
        rows[batch] = profile_decode(llm, batch, args.prompt_len, args.steps)
        print(f"{batch:>6} " + " ".join(f"{rows[batch][p]:>15.3f}" for p in PHASES) + f" {rows[batch]['total']:>9.3f}")
    result = {**meta, "model": args.model, "quantization": args.quantization, "phases_ms": rows}
    if args.kernels and llm.llm_engine.runner.device.type == "cuda":
        result["decode_kernels"] = kernel_table(llm, args.prompt_len, max(batches))
    if args.out:
        write_json(Path(args.out) / f"step_profile{'_' + args.quantization if args.quantization else ''}.json", result)
    return result


def main_trace(args) -> dict:
    num_requests, prompt_len, output_len = (int(v) for v in args.trace.split("x"))
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, device=args.device,
              max_num_seqs=num_requests, max_model_len=prompt_len + output_len + 16,
              max_num_batched_tokens=max(args.max_num_batched_tokens, num_requests),
              async_scheduling=False if args.no_async_scheduling else None, enforce_eager=args.enforce_eager,
              kv_cache_memory=None if args.device != "cpu" else 256 * 2**20)
    meta = run_metadata(llm.llm_engine.runner.device)
    print(f"step trace | {meta['device']} | commit {meta['commit']} | {args.model} | {args.trace} | "
          f"max_num_batched_tokens {args.max_num_batched_tokens} | async {llm.llm_engine.async_scheduling}")
    result = {**meta, "model": args.model, **trace_workload(llm, num_requests, prompt_len, output_len, args.kernels)}
    print(json.dumps({k: v for k, v in result.items() if k in ("elapsed_s", "output_tokens_per_s", "steps",
                                                                  "allocator")}, indent=1))
    if args.out:
        write_json(Path(args.out) / f"step_trace_{args.trace}.json", result)
    return result


if __name__ == "__main__":
    main()
