"""Where does one engine step spend its time? Times each phase of `LLMEngine.step()` (schedule, input
preparation, forward, logits + sampling, update, outputs) with a device sync between phases, for decode
steps at a few batch sizes. The phases run one after another here; in the engine, async scheduling
overlaps the host phases of one step with the device work of the previous one.

  python bench/profile_step.py --model llama-3-8b --batch 1,64 [--device cpu] [--out DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import run_metadata, write_json  # noqa: E402
from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.worker.inputs import prepare_inputs  # noqa: E402

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
        sync()
        t2 = time.perf_counter()
        hidden = runner._forward(inputs)
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


def kernel_table(llm: LLM, prompt_len: int, batch: int) -> None:
    """torch.profiler's top CUDA kernels for one prefill step of `batch` prompts and 10 decode steps."""
    from torch.profiler import ProfilerActivity, profile
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
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
            print(f"--- {label}: {n_tokens} tokens in the last step, {1e3 * (time.perf_counter() - start):.1f} ms "
                  f"wall (profiled)")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
            while steps == 1 and engine.scheduler.waiting:  # finish prefill before profiling decode
                out = engine.scheduler.schedule()
                engine.scheduler.update(out, engine.runner.execute(out))
        while engine.has_unfinished_requests():
            engine.step()


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
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, device=args.device,
              max_num_seqs=max(batches), max_model_len=args.prompt_len + args.steps + 64,
              enforce_eager=args.enforce_eager, kv_cache_memory=None if args.device != "cpu" else 256 * 2**20)
    meta = run_metadata(llm.llm_engine.runner.device)
    print(f"step profile | {meta['device']} | commit {meta['commit']} | {args.model} | eager={args.enforce_eager}")
    rows = {}
    print(f"{'batch':>6} " + " ".join(f"{p:>15}" for p in PHASES) + f" {'total ms':>9}")
    for batch in batches:
        rows[batch] = profile_decode(llm, batch, args.prompt_len, args.steps)
        print(f"{batch:>6} " + " ".join(f"{rows[batch][p]:>15.3f}" for p in PHASES) + f" {rows[batch]['total']:>9.3f}")
    if args.kernels and llm.llm_engine.runner.device.type == "cuda":
        kernel_table(llm, args.prompt_len, max(batches))
    result = {**meta, "model": args.model, "phases_ms": rows}
    if args.out:
        write_json(Path(args.out) / "step_profile.json", result)
    return result


if __name__ == "__main__":
    main()
