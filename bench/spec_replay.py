"""Proposer quality apart from timing: the real default model's greedy outputs for the speculation workloads
(bench/spec_workloads.py), replayed through each host proposer as if every step verified its drafts.

At each position a proposer drafts from the prompt and the output so far (and, for suffix decoding, from
the outputs of the requests before it, in the order a batch-1 run serves them); the drafts that agree with
the recorded output are accepted and the replay moves past them and the token after them. Greedy outputs
with speculation equal those without, so this is what a batch-1 run would verify (after a plain step the drafts
are made behind the token in flight, as under async scheduling). Reported per workload and proposer: steps,
verify steps, tokens per step
(the speedup's ceiling when a verify step costs a plain one), tokens per verify step, acceptance and the
host microseconds per lookup, for
n-gram (the benchmark's configuration), a grid of suffix decoding's draft factor and probability floor, and
suffix decoding's defaults with the own history drafting after a match of one token instead of two or more
(`suffix_own_match1`), with the cache drafting after a match of any length instead of three tokens or more
(`suffix_cache_match1`) and without the cache of other requests' outputs (`suffix_own_only`).
The result file is per device (`spec_replay_<device>.json`): the outputs, and so the replay, depend on
the device's arithmetic.

Usage: python bench/spec_replay.py --out DIR [--quick]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import device_slug, print_table, run_metadata, write_json  # noqa: E402
from bench.spec_workloads import BATCH1_PROMPTS, NGRAM, WORKLOADS  # noqa: E402
from minivllm.spec_decode.ngram import token_history  # noqa: E402

CASES = tuple(BATCH1_PROMPTS.items())
SUFFIX_GRID = [(factor, prob) for factor in (2.0, 4.0, 8.0) for prob in (0.5, 0.7)]


def replay(proposer, records: list[tuple[list[int], list[int]]], k: int) -> dict:
    """Verify `proposer`'s drafts (up to `k`) against each record's output, one request after another; a
    proposer with `add_output` gets each finished output, as the engine hands it to the suffix cache. After a
    plain step the proposer drafts behind the token in flight, as under async scheduling (the history without
    the newest token, whose stand-in it skips); after a verify step, which the engine reads back first, from
    the whole history."""
    steps = verifies = drafted = accepted = 0
    seconds = 0.0
    for prompt, output in records:
        position, verified = 1, True   # the first output token comes from the prompt's step, read back
        while position < len(output):
            behind = not verified and position >= 2
            history = token_history(prompt + output[:position - behind])   # as the controller keeps it
            started = time.perf_counter()
            drafts = proposer.propose(history, k, skip=int(behind))
            seconds += time.perf_counter() - started
            verified = bool(drafts)
            hits = 0
            while hits < len(drafts) and position + hits < len(output) and drafts[hits] == output[position + hits]:
                hits += 1
            steps, verifies = steps + 1, verifies + bool(drafts)
            drafted, accepted = drafted + len(drafts), accepted + hits
            position += hits + 1
        if hasattr(proposer, "add_output"):
            proposer.add_output(output)
    generated = sum(len(output) - 1 for _, output in records)
    return {"steps": steps, "verify_steps": verifies, "tokens_per_step": generated / max(steps, 1),
            "tokens_per_verify": 1 + accepted / max(verifies, 1), "acceptance": accepted / max(drafted, 1),
            "us_per_proposal": seconds / max(steps, 1) * 1e6}


def proposers(quick: bool) -> dict:
    """name -> (a fresh proposer, its draft cap)."""
    from minivllm.spec_decode.config import SpeculativeConfig
    from minivllm.spec_decode.ngram import NgramProposer
    from minivllm.spec_decode.suffix import SuffixProposer
    default = SpeculativeConfig(method="suffix")
    made = {"ngram": (lambda: NgramProposer(NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"]),
                      NGRAM["num_speculative_tokens"])}
    settings = {"max_depth": default.suffix_decoding_max_tree_depth,
                "max_cached_requests": default.suffix_decoding_max_cached_requests,
                "max_spec_factor": default.suffix_decoding_max_spec_factor,
                "min_token_prob": default.suffix_decoding_min_token_prob,
                "min_cache_match": default.suffix_decoding_min_cache_match}

    def suffix(**changes):   # suffix decoding at its defaults but for `changes`, under its default draft cap
        return lambda: SuffixProposer(**{**settings, **changes}), default.num_speculative_tokens
    for factor, prob in SUFFIX_GRID[:2] if quick else SUFFIX_GRID:
        made[f"suffix_f{factor:g}_p{prob:g}"] = suffix(max_spec_factor=factor, min_token_prob=prob)
    # The defaults with the own history drafting after a match of one token: what such matches add.
    made["suffix_own_match1"] = suffix(min_own_match=1)
    # The defaults with the cache drafting after a match of any length: what matches of one or two tokens add.
    made["suffix_cache_match1"] = suffix(min_cache_match=1)
    # The defaults with no cache of other requests' outputs: what the cache adds.
    made["suffix_own_only"] = suffix(max_cached_requests=0)
    return made


def record(llm, workload: str, count: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    from minivllm import SamplingParams
    chats = [chat for _, chat in WORKLOADS[workload](count)]
    outputs = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="two prompts per workload, 16 tokens (CPU smoke test)")
    args = parser.parse_args(argv)
    from minivllm import LLM
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = [(workload, 2) for workload, _ in CASES] if args.quick else CASES
    max_tokens = 16 if args.quick else 256
    result = run_metadata(device)
    print(f"speculation replay | {result['device']} | commit {result['commit']} | {result['date']}")
    options = {"gpu_memory_utilization": 0.5} if device.type == "cuda" else {"dtype": "float32"}
    llm = LLM(seed=0, max_model_len=4096, max_num_seqs=max(count for _, count in cases), **options)
    result.update(model="SmolLM2-135M-Instruct", max_tokens=max_tokens, workloads={})
    rows = []
    for workload, count in cases:
        records = record(llm, workload, count, max_tokens)
        entry = result["workloads"][workload] = {"prompts": count,
                                                 "output_tokens": sum(len(output) for _, output in records)}
        for name, (make, k) in proposers(args.quick).items():
            entry[name] = {"k": k, **replay(make(), records, k)}
            rows.append({"workload": workload, "proposer": name, **entry[name]})
    print_table(rows, "replayed greedy outputs: every step verifies its drafts")
    write_json(args.out / f"spec_replay_{device_slug(result['device'])}.json", result)
    return result


if __name__ == "__main__":
    main()
