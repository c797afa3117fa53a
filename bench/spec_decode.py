"""Speculative decoding benchmark: what each proposer buys, and what it costs.

Parts, all in one run on one device (results in spec_decode_<gpu>.json with device, commit, date):
  compare the real default model (SmolLM2-135M), greedy, off / n-gram (up to 15 drafts, the default; and
         up to 5) / suffix decoding alternating on one engine, per workload and batch size
         (bench/spec_workloads.py: input-grounded, open-ended and repetitive chats built from real text); gives
         the top-level keys grounded_b1_speedup, open_b1_speedup, grounded_b8_speedup, grounded_b32_speedup
         (n-gram at its defaults) and
         suffix_repetitive_b1_speedup, ngram_repetitive_b1_speedup (each the median over eight sweeps of a mode's
         tokens/s over off's in the same sweep).
  real   the real default model, batch 1, greedy, the input-grounded chat prompts: tokens/s with no
         speculation, n-gram, suffix decoding and draft-layers, the acceptance per draft position and the
         mean tokens per verify step; outputs compared.
  load   dummy Llama-3-8B, W1 (64 x 512 -> 256) and 256 x 512 -> 256, speculation (n-gram, adaptive)
         off and on in the same engine, three runs each, alternating (medians): the adaptive controller
         must not lose throughput (top-level w1_load_ratio: on over off at W1).
  idle   host time per step of an enabled speculator whose drafts never pay (the controller's decision,
         proposals, cost bookkeeping and suffix-cache work) at batch 1 to 256, per proposer.
  verify dummy Llama-3-8B at batch 1, 512-token context: the time of one verify step with k = 1..8
         drafts relative to one decode step (both run synchronously through the runner), from which
         the speedup at any acceptance rate can be read: (1 - a^(k+1)) / (1 - a) / cost(k).
  steps  the real model's shapes (dummy weights) at batch 1 through the whole engine loop: wall time
         per step of plain decoding and of steps verifying k = 1..5 drafts (not run by default).
  graphs the real model's shapes (dummy weights): device microseconds per replay of the decode CUDA graph of
         1 to 64 rows (a batch-1 verify step of up to 7 drafts replays the 8-row one), replayed
         back to back, so no host time is in it (top-level graph_replay_us; not run by default).

Usage: python bench/spec_decode.py --out DIR [--parts compare,real,load,verify,idle] [--quick]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import device_slug, graph_replay_us, print_table, run_metadata, write_json  # noqa: E402
from bench.spec_workloads import BATCH1_PROMPTS, NGRAM, SUFFIX, grounded_chats, run_compare  # noqa: E402,F401

LOAD_ORDER = ("off", "on", "on", "off", "off", "on")   # each mode early and late
# The `compare` part's cases: (label, workload, batch, prompts), and the top-level keys they give.
COMPARE_CASES = [("grounded_b1", "grounded", 1, BATCH1_PROMPTS["grounded"]),
                 ("open_b1", "open", 1, BATCH1_PROMPTS["open"]), ("grounded_b8", "grounded", 8, 32),
                 ("grounded_b32", "grounded", 32, 64), ("repetitive_b1", "repetitive", 1, BATCH1_PROMPTS["repetitive"])]
QUICK_COMPARE_CASES = [("grounded_b1", "grounded", 1, 1), ("open_b1", "open", 1, 1), ("grounded_b8", "grounded", 2, 2),
                       ("grounded_b32", "grounded", 2, 2), ("repetitive_b1", "repetitive", 1, 2)]


class GcCollections:
    """Python's garbage collections while open: count and host milliseconds per generation. A full
    collection walks every tracked object of an engine, which could show in a batch-1 run of under a second."""

    def __init__(self) -> None:
        self.counts, self.seconds, self._started = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._started

    def close(self) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        return {f"gen{g}": {"collections": self.counts[g], "ms": round(self.seconds[g] * 1e3, 2)} for g in range(3)}


# ---- parts ----------------------------------------------------------------------------------------------------
def _spec_summary(stats, elapsed: float, num_tokens: int) -> dict:
    result = {"output_tokens": num_tokens, "elapsed_s": elapsed, "tokens_per_s": num_tokens / elapsed}
    if stats is not None and stats.num_drafts:
        result.update(
            num_verify=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
            acceptance_rate=stats.num_accepted_tokens / stats.num_draft_tokens,
            mean_tokens_per_verify=1 + stats.num_accepted_tokens / stats.num_drafts,
            acceptance_per_position=[n / stats.num_drafts for n in stats.accepted_per_position])
    return result


def _run_real_config(args, name: str, config: dict | None, chats, params, decode_rows: int) -> dict:
    """One engine with `config`, warmed up, timed over every prompt at batch 1."""
    from minivllm import LLM
    from minivllm.worker import cuda_graph
    cuda_graph.MAX_DECODE_ROWS_QUERY_LEN = 0 if name == "ngram_mixed_verify" else decode_rows
    llm = LLM(seed=0, max_model_len=args.real_max_model_len, speculative_config=config, **args.engine_options)
    if name == "ngram_unchained":
        llm.llm_engine.spec.chains = lambda scheduled: False
    # Warm-up: every prompt once, each with a different first word (no prefix-cache hits later), so
    # that first-use costs (compiles, graph buffers, allocator growth) stay out of the timed run.
    for _, chat in chats:
        warm = [{"role": "user", "content": "Please. " + chat[0]["content"]}]
        llm.chat(warm, params, use_tqdm=False)
    spec, scheduler = llm.llm_engine.spec, llm.llm_engine.scheduler
    decisions = None
    if spec is not None:
        spec.reset_stats()
        if spec.suffix is not None:   # the warm-up's outputs are the timed ones' near copies: forget them
            spec.suffix.cache.clear()
        decisions = _count_decisions(spec)
    tracer = None
    if args.trace and not name.startswith("draft"):
        from bench.profile_step import StepTracer
        tracer = StepTracer(llm.llm_engine)
    chained, discarded = (spec.num_chained_steps if spec else 0), scheduler.num_discarded_steps
    if args.collect_before_timing:
        gc.collect()   # the engine's construction leaves a full collection pending; not part of decoding
    collections = GcCollections()
    outputs, started = [], time.perf_counter()
    for _, chat in chats:   # batch 1: one request at a time
        outputs.append(llm.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids)
    elapsed = time.perf_counter() - started
    collections.close()
    result = _spec_summary(spec.stats if spec else None, elapsed, sum(len(o) for o in outputs))
    result["gc"] = collections.summary()
    result["outputs"] = outputs
    if spec is not None:   # steps launched behind a verify step before it was read back, and those discarded
        result.update(num_chained_steps=spec.num_chained_steps - chained,
                      num_discarded_steps=scheduler.num_discarded_steps - discarded,
                      controller={k: round(v, 2) if isinstance(v, float) else v for k, v in decisions.items()})
    if tracer is not None:   # per step kind: host launch, host wait, device time, device idle
        tracer.close()
        result["step_trace"] = {k: v for k, v in tracer.summary().items() if k != "prefill_rows"}
        del tracer   # it holds the engine: the next config's engine needs its memory
    del llm, spec, scheduler
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return result


def run_real(args) -> dict:
    from minivllm import LLM, SamplingParams
    from minivllm.worker import cuda_graph
    decode_rows = cuda_graph.MAX_DECODE_ROWS_QUERY_LEN
    chats = grounded_chats(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    configs = {"off": None, "ngram": NGRAM, "suffix": SUFFIX}
    for k in args.ngram_max_k:     # adaptive, with a longer draft cap
        configs[f"ngram_max{k}"] = {**NGRAM, "num_speculative_tokens": k}
    if args.compare_unchained:     # every verify step read back before the next step is scheduled
        configs["ngram_unchained"] = NGRAM
    for k in args.ngram_fixed_k:   # the controller's choice against fixed draft lengths
        configs[f"ngram_k{k}"] = {**NGRAM, "num_speculative_tokens": k, "adaptive": False}
    if args.compare_mixed_verify:  # verify steps through the mixed graph and varlen kernel instead
        configs["ngram_mixed_verify"] = NGRAM
    for layers in args.draft_layers:
        configs[f"draft_layers_{layers}"] = {"method": "draft_model", "draft_layers": layers,
                                             "num_speculative_tokens": 3}
    # Untimed rounds first: a first round can run slowest, as if some first use (a compile,
    # a pool's growth) came after one engine's warm-up and before the next engine's.
    rounds = [{name: _run_real_config(args, name, config, chats, params, decode_rows)
               for name, config in configs.items()} for _ in range(args.warmup_rounds + args.rounds)]
    rounds = rounds[args.warmup_rounds:]
    results, reference = {}, rounds[0]["off"].pop("outputs")
    for name in configs:
        runs = sorted((r[name] for r in rounds), key=lambda r: r["tokens_per_s"])
        results[name] = runs[(len(runs) - 1) // 2]   # the median run (the lower middle of an even count)
        for run in runs:
            outputs = run.pop("outputs", None)
            if outputs is not None and name != "off":
                run["outputs_identical_to_off"] = sum(a == b for a, b in zip(outputs, reference))
        if args.rounds > 1:
            results[name]["tokens_per_s_runs"] = [r[name]["tokens_per_s"] for r in rounds]
            results[name]["gc_runs"] = [r[name]["gc"] for r in rounds]
    off = results["off"]["tokens_per_s"]
    for name, result in results.items():
        result["speedup_vs_off"] = result["tokens_per_s"] / off
        print(f"  {name}: {result['tokens_per_s']:.1f} tok/s, x{result['speedup_vs_off']:.2f}")
    cuda_graph.MAX_DECODE_ROWS_QUERY_LEN = decode_rows
    return {"model": "SmolLM2-135M-Instruct", "batch": 1, "max_tokens": args.max_tokens,
            "prompts": [kind for kind, _ in chats], "configs": configs, "results": results}


def _count_decisions(controller) -> dict:
    """Wrap the controller's choose_k / propose to count decisions and time them on the host."""
    counts: dict = {}
    choose_k, propose = controller.choose_k, controller.propose

    def timed(name, fn, *a):
        started = time.perf_counter()
        result = fn(*a)
        counts[f"{name}_ms"] = counts.get(f"{name}_ms", 0.0) + 1e3 * (time.perf_counter() - started)
        return result

    def counted_choose_k(running):
        k = timed("choose_k", choose_k, running)
        counts[f"k={k}"] = counts.get(f"k={k}", 0) + 1
        return k

    def counted_propose(running, k):
        n = timed("propose", propose, running, k)
        counts["sequences_with_drafts"] = counts.get("sequences_with_drafts", 0) + n
        return n
    controller.choose_k, controller.propose = counted_choose_k, counted_propose
    return counts


def run_load(args) -> list[dict]:
    from minivllm import LLM
    from bench.throughput import Workload, random_prompts, timed_generate, warm_up
    rows = []
    for workload in args.load_workloads:
        llm = LLM(model=args.dummy_model, load_format="dummy", skip_tokenizer_init=True, seed=0,
                  max_num_seqs=workload.num_requests, max_model_len=workload.prompt_len + workload.output_len + 16,
                  max_num_batched_tokens=max(8192, workload.num_requests), speculative_config=NGRAM,
                  **args.engine_options)
        engine = llm.llm_engine
        controller, vocab = engine.spec, engine.vocab_size
        decisions = _count_decisions(controller)
        warm_up(llm, workload, vocab)
        decisions.clear()
        # Alternating runs, medians: throughput drifts by a few % between runs of one engine (of off / on /
        # off at 256 x 512 -> 256, the first was 3.6% faster than the third), so one pair can't judge 3%.
        row = {"workload": str(workload), "order": list(LOAD_ORDER), "off_runs": [], "on_runs": []}
        for i, mode in enumerate(LOAD_ORDER):
            engine.spec = None if mode == "off" else controller
            tracer = None
            if args.trace:   # per step kind: host time, device time, and the device's idle time before each step
                from bench.profile_step import StepTracer
                tracer = StepTracer(engine)
            collections = GcCollections()
            result = timed_generate(llm, random_prompts(workload, vocab, seed=len(rows) * 100 + i),
                                    workload.output_len)
            collections.close()
            row[f"{mode}_runs"].append(result["output_tokens_per_s"])
            row.setdefault(f"{mode}_gc", []).append(collections.summary())
            if tracer is not None:
                tracer.close()
                summary = tracer.summary()
                row.setdefault(f"{mode}_trace", []).append(
                    {kind: {k: round(v, 3) for k, v in summary[kind].items() if k.startswith(("steps", "sum_"))}
                     for kind in ("prefill", "decode", "verify") if kind in summary})
                del tracer
        engine.spec = controller
        off = statistics.median(row["off_runs"])
        row["off_tokens_per_s"], row["on_tokens_per_s"] = off, statistics.median(row["on_runs"])
        row["on_over_off"] = row["on_tokens_per_s"] / off
        row.update({f"spec_{k}": v for k, v in _spec_summary(controller.stats, 1.0, 1).items()
                    if k.startswith(("num_", "acceptance_rate", "mean_"))})
        row["controller"] = dict(decisions)   # k chosen per step, lookups, host time in the controller
        row["controller"]["plain_cost_ms"] = {b: round(1e3 * statistics.median(v), 3)
                                              for b, v in sorted(controller.costs.plain_windows.items())}
        row["controller"]["verify_extra_ms"] = {b: round(1e3 * statistics.median(v), 3)
                                                for b, v in sorted(controller.costs.extra_windows.items())}
        rows.append(row)
        print(f"  {workload}: off {off:.0f} tok/s, on {row['on_tokens_per_s']:.0f} tok/s "
              f"(x{row['on_over_off']:.3f})")
        del llm, engine, controller
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def run_verify_cost(args) -> list[dict]:
    """Synchronous runner steps of one sequence at a 512-token context: decode vs verify with k drafts."""
    from minivllm import LLM, SamplingParams
    llm = LLM(model=args.dummy_model, load_format="dummy", skip_tokenizer_init=True, seed=0, max_num_seqs=8,
              max_model_len=2048, **args.engine_options)
    engine = llm.llm_engine
    scheduler, runner = engine.scheduler, engine.runner
    engine.add_request("verify", list(range(1000, 1512)), SamplingParams(temperature=0.0, max_tokens=1500,
                                                                        ignore_eos=True))
    while not engine.scheduler.running or engine.scheduler.running[0].num_output_tokens == 0:
        engine.step()
    while engine._in_flight is not None:
        engine.step()
    seq = scheduler.running[0]

    def one_step(k: int) -> float:
        seq.spec_token_ids = [seq.token_ids[-1]] * k
        out = scheduler.schedule()
        if k and not out.spec_token_ids:
            raise RuntimeError("the scheduler dropped the drafts")
        started = time.perf_counter()
        model_output = runner.execute(out)
        seconds = time.perf_counter() - started
        scheduler.update(out, model_output)
        return seconds

    rows = []
    for k in range(0, args.max_verify_k + 1):
        times = [one_step(k) for _ in range(args.verify_repeats + 5)][5:]
        rows.append({"k": k, "ms": 1e3 * statistics.median(times)})
    base = rows[0]["ms"]
    for row in rows:
        row["relative_to_decode"] = row["ms"] / base
        # Tokens per step at acceptance a, over the step's cost: the speedup at that acceptance rate.
        for a in (0.5, 0.7, 0.9):
            expected = (1 - a ** (row["k"] + 1)) / (1 - a)
            row[f"speedup_at_a{a}"] = expected / row["relative_to_decode"]
    return rows


def _profile_rows(profiler: cProfile.Profile, num_steps: int, top: int = 40) -> list[dict]:
    """cProfile's functions by self time, then minivllm's own by cumulative time (where a step's host time
    goes, layer by layer): calls and milliseconds (self, cumulative) per engine step."""
    stats = pstats.Stats(profiler).stats
    rows = [{"function": f"{Path(file).name}:{line}({name})", "calls_per_step": calls / num_steps,
             "self_ms_per_step": 1e3 * self_s / num_steps, "cum_ms_per_step": 1e3 * cum_s / num_steps,
             "ours": "minivllm" in file}
            for (file, line, name), (_, calls, self_s, cum_s, _) in stats.items()]
    by_self = sorted(rows, key=lambda r: -r["self_ms_per_step"])[:top]
    by_cum = [r for r in sorted(rows, key=lambda r: -r["cum_ms_per_step"]) if r["ours"] and r not in by_self][:top]
    return [{k: v for k, v in r.items() if k != "ours"} for r in by_self + by_cum]


def run_step_cost(args) -> list[dict]:
    """The real engine loop at batch 1 on the real model's shapes (dummy weights, `--steps-model`): the wall
    time per step of plain decoding (async scheduling) and of steps verifying k = 1..5 drafts (the
    proposer stubbed to always propose k tokens, so every step verifies). Medians over steady-state steps;
    one engine, speculation switched off for k = 0."""
    from minivllm import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=args.step_repeats + 40, ignore_eos=True)
    llm = LLM(model=args.steps_model, load_format="dummy", skip_tokenizer_init=True, seed=0, max_num_seqs=8,
              max_model_len=2048, speculative_config={**NGRAM, "num_speculative_tokens": 5, "adaptive": False},
              **args.engine_options)
    engine = llm.llm_engine
    controller = engine.spec
    # dummy weights: few drafts would be accepted, so every step proposes the last token n times
    controller.host_proposer.propose = lambda token_ids, n, skip=0: [int(token_ids[-1])] * n
    rows = []
    max_k = controller.max_k
    for k in range(0, max_k + 1):
        engine.spec, controller.max_k = (controller if k else None), max(k, 1)
        controller.reset_stats()
        engine.add_request(f"steps-{k}", list(range(1000, 1512)), params)
        tracer = None
        if args.trace:
            from bench.profile_step import StepTracer
            tracer = StepTracer(engine)
        times, tokens = [], []
        profiler = cProfile.Profile() if args.profile and k in (0, max_k) else None
        if profiler is not None:
            profiler.enable()
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
            tokens.append(engine.num_generation_tokens)
        if profiler is not None:
            profiler.disable()
        steady = slice(10, len(times) - 5)   # past the prefill and warm-up, before the tail
        num_steps = len(times[steady])
        rows.append({"k": k, "ms_per_step": 1e3 * statistics.median(times[steady]), "steps": num_steps,
                     "tokens_per_step": (tokens[steady.stop - 1] - tokens[steady.start - 1]) / num_steps,
                     "num_verify": controller.stats.num_drafts if k else 0})
        if profiler is not None:   # the host functions that take the most time per step, self time first
            rows[-1]["host_profile"] = _profile_rows(profiler, len(times))
        if tracer is not None:   # medians per step kind: host launch, host wait, device time, device idle
            tracer.close()
            summary = tracer.summary()
            rows[-1]["trace"] = {kind: {key: value for key, value in summary[kind].items() if key.startswith("median")}
                                 for kind in ("decode", "verify") if kind in summary}
    for row in rows:
        row["relative_to_plain"] = row["ms_per_step"] / rows[0]["ms_per_step"]
    del llm, engine, controller
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def run_graph_replays(args) -> dict:
    """Device microseconds per replay of each decode graph of up to 64 rows, 200 replays back to back after 20
    untimed ones, every row at a 400-token context; the dense GEMV choices the tuner made are printed."""
    from minivllm import LLM, SamplingParams
    from minivllm.kernels import tuning
    llm = LLM(model=args.steps_model, load_format="dummy", skip_tokenizer_init=True, seed=0, max_num_seqs=64,
              max_model_len=2048, **args.engine_options)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("graphs", list(range(1000, 1400)), params)
    while engine.has_unfinished_requests():   # compiles and tunes every kernel of the decode path
        engine.step()
    runner = engine.runner.graph_runner
    runner.seq_lens[:64] = 400
    result = {}
    for rows in (1, 2, 4, 8, 16, 32, 48, 64):
        result[str(rows)] = graph_replay_us(runner.graphs[rows], 200, warmup=20)
    runner.seq_lens.zero_()
    for key, timings in tuning.measured.items():   # the fastest three candidates of each shape, us
        if key[0] == "dense_gemv":
            print(key[2:], [(round(1e6 * t, 2), c) for t, c in sorted(timings, key=lambda tc: tc[0])][:3])
    del llm, engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return result


def run_idle_cost(args) -> dict:
    """Host microseconds per step that an enabled speculator adds when its drafts never pay: `choose_k`,
    `propose`, `observe_step` and `forget` (a finished output), as the engine calls them, on decoding sequences of
    real text (no model: a plain step does none of this, so this is the whole difference on the host).
    Steps are priced so that drafts cost more than they gain (an 8B-like step whose tokens cost like
    prefill), every verification rejects, and each finished request hands the suffix cache its output."""
    import pydoc_data.topics

    from minivllm import SamplingParams
    from minivllm.core.sequence import SequenceGroup
    from minivllm.spec_decode.config import SpeculativeConfig
    from minivllm.spec_decode.controller import SpeculationController
    words = " ".join(pydoc_data.topics.topics["try"].split()).split(" ")
    text = [hash(w) % 50_000 for w in words]   # word ids: real text's repetitions, no tokenizer needed
    rows = []
    for method, config in (("ngram", NGRAM), ("suffix", SUFFIX)):
        for batch in args.idle_batches:
            controller = SpeculationController(SpeculativeConfig.from_dict(config), max_model_len=8192)
            seqs = []
            for i in range(batch):
                seq = SequenceGroup(f"r{i}", None, text[i % 97:i % 97 + 300], SamplingParams(max_tokens=4096)).seqs[0]
                seq.append_token(text[(i + 300) % len(text)])
                seq.num_computed_tokens = seq.num_tokens - 1
                seqs.append(seq)
            step_s = 0.005 + 2e-5 * batch
            controller.observe_step(batch, batch, step_s, speculative=False)
            controller.observe_step(8 * batch + 512, batch, step_s * 8, speculative=False)
            times = []
            for step in range(args.idle_steps):
                started = time.perf_counter()
                k = controller.choose_k(seqs)
                controller.propose(seqs, k)
                controller.observe_step(batch, batch, step_s, speculative=False)
                if step % 64 == 0:   # a request finishes: its 256-token output goes to the suffix cache
                    controller.forget(-1 - step, seqs[0].output_token_ids[-256:])
                times.append(time.perf_counter() - started)
                for seq in seqs:
                    if seq.spec_token_ids:   # every draft rejected; the sequence moves on by one token
                        controller.observe_verification(seq, len(seq.spec_token_ids), 0)
                        seq.spec_token_ids = []
                    seq.append_token(text[(step + seq.seq_id) % len(text)])
                    seq.num_computed_tokens += 1
            rows.append({"method": method, "batch": batch, "mean_us": 1e6 * statistics.mean(times),
                         "median_us": 1e6 * statistics.median(times), "max_us": 1e6 * max(times),
                         "steps_with_drafts": controller.stats.num_drafts})
    return {"note": "host microseconds the speculator adds per engine step (mean, median, most), a finished "
                    "request's output entering the suffix cache every 64 steps included", "rows": rows}


# ---- main ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    from bench.throughput import Workload
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="compare,real,load,verify,idle")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke test)")
    parser.add_argument("--draft-layers", default="8,16", help="draft_layers values to measure (real part)")
    parser.add_argument("--ngram-fixed-k", default="", help="real part: also n-gram with these fixed k (no adaptivity)")
    parser.add_argument("--ngram-max-k", default="", help="real part: also adaptive n-gram with these draft caps")
    parser.add_argument("--compare-unchained", action="store_true",
                        help="real part: also n-gram reading every verify step back before scheduling the next")
    parser.add_argument("--compare-mixed-verify", action="store_true",
                        help="real part: also n-gram with verify steps through the mixed graph (not decode rows)")
    parser.add_argument("--dummy-model", help="verify and load parts: the dummy config to time (default: "
                        "llama-3-8b, tiny-llama with --quick)")
    parser.add_argument("--steps-model", default="smollm2-135m",
                        help="steps part: the dummy config (a name or a .json path) whose step costs are timed")
    parser.add_argument("--profile", action="store_true",
                        help="steps part: cProfile the host in plain steps and in steps verifying the most drafts")
    parser.add_argument("--rounds", type=int, default=1,
                        help="real part: time every config this many times, in turn (the median run is reported)")
    parser.add_argument("--warmup-rounds", type=int, default=0,
                        help="real part: rounds of every config run first and not reported")
    parser.add_argument("--collect-before-timing", action="store_true",
                        help="real part: one full garbage collection after each engine's warm-up, before timing")
    parser.add_argument("--trace", action="store_true",
                        help="real, steps and load parts: trace each step (bench/profile_step.py's StepTracer)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.draft_layers = [int(x) for x in args.draft_layers.split(",") if x]
    args.ngram_fixed_k = [int(x) for x in args.ngram_fixed_k.split(",") if x]
    args.ngram_max_k = [int(x) for x in args.ngram_max_k.split(",") if x]
    args.compare_cases, args.compare_rounds = (QUICK_COMPARE_CASES, 1) if args.quick else (COMPARE_CASES, 4)
    args.compare_max_tokens = 8 if args.quick else 256
    args.idle_batches, args.idle_steps = ((1, 32), 200) if args.quick else ((1, 8, 32, 256), 2000)
    args.compare_engine_options = ({"gpu_memory_utilization": 0.5} if device.type == "cuda" else
                                   {"kv_cache_memory": 64 << 20, "dtype": "float32"})   # CPU bf16 is slow
    if args.quick:
        args.num_prompts, args.max_tokens, args.max_verify_k, args.verify_repeats = 3, 24, 3, 3
        args.step_repeats = 20
        args.real_max_model_len = 1024
        args.default_dummy_model = "tiny-llama"
        args.load_workloads = [Workload(4, 32, 16)]
        args.engine_options = {"kv_cache_memory": 64 << 20} if device.type == "cpu" else {}
    else:
        args.num_prompts, args.max_tokens, args.max_verify_k, args.verify_repeats = 9, 256, 8, 30
        args.step_repeats = 300
        args.real_max_model_len = 4096
        args.default_dummy_model = "llama-3-8b"
        args.load_workloads = [Workload(64, 512, 256), Workload(256, 512, 256)]
        args.engine_options = {"gpu_memory_utilization": 0.9} if device.type == "cuda" else {}
    args.dummy_model = args.dummy_model or args.default_dummy_model
    result = run_metadata(device)
    print(f"speculative decoding benchmark | {result['device']} | commit {result['commit']} | {result['date']}")
    parts = args.parts.split(",")
    if "compare" in parts:
        print("real model, speculation off / n-gram / suffix per workload and batch:")
        result["compare"] = compare = run_compare(args)
        for label in ("grounded_b1", "open_b1", "grounded_b8", "grounded_b32"):
            result[f"{label}_speedup"] = compare[label]["ngram_speedup"]
        for method in ("suffix", "ngram"):
            result[f"{method}_repetitive_b1_speedup"] = compare["repetitive_b1"][f"{method}_speedup"]
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if "real" in parts:
        print("real model, batch 1:")
        result["real_batch1"] = run_real(args)
    if "verify" in parts:
        print(f"verify-step cost, {args.dummy_model}, batch 1:")
        result["verify_cost"] = run_verify_cost(args)
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        print_table(result["verify_cost"], "verify step vs decode step")
    if "steps" in parts:
        print(f"engine steps at batch 1, {args.steps_model} (dummy weights):")
        result["step_cost"] = run_step_cost(args)
        rows = result["step_cost"]
        print_table([{k: v for k, v in row.items() if k not in ("trace", "host_profile")} for row in rows],
                    "step wall time, plain vs verifying k drafts")
        for row in rows:
            if "host_profile" in row:
                print_table(row["host_profile"][:25], f"host functions by self time, k = {row['k']} (ms per step)")
        traced = [{"k": row["k"], "kind": kind, **{key.removeprefix("median_"): value for key, value in medians.items()}}
                  for row in rows for kind, medians in row.get("trace", {}).items()]
        if traced:
            print_table(traced, "per step kind, medians (ms): host launch parts, host wait, device time, device idle")
    if "graphs" in parts:
        result["graph_replay_us"] = run_graph_replays(args)
        print("decode graph replays, device us by rows:",
              {k: round(v, 1) for k, v in result["graph_replay_us"].items()})
    if "load" in parts:
        print(f"under load, {args.dummy_model}:")
        result["load"] = run_load(args)
        result["w1_load_ratio"] = result["load"][0]["on_over_off"]
    if "idle" in parts:
        print("host time of an idle speculator per step:")
        result["idle_host_cost"] = run_idle_cost(args)
        print_table(result["idle_host_cost"]["rows"], "idle speculator, host us per step")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"spec_decode_{device_slug(result['device'])}.json"
    write_json(path, result)
    return result


if __name__ == "__main__":
    main()
