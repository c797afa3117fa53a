"""Chat workloads for the speculation benchmark, built from text that ships with Python, and the `compare`
part of bench/spec_decode.py: speculation on against off per workload and batch size, in one engine.

  grounded    summarise or rewrite a passage of the language reference (`pydoc_data.topics`), or add a
              docstring and type hints to a standard-library function: the answer copies its input.
  open        open-ended chat (a story, an explanation, a list of ideas), written here: nothing to copy.
  repetitive  the same task issued again and again with small variations, as an agent issues it: write user
              documentation for successive revisions of a standard-library function (eight: each combination
              of a comment added at the top of its body, its first parameter renamed and a note appended),
              two functions in turn. The documentation of a revision repeats most of the text written for the
              earlier revisions, which is in other requests' outputs, not in its own prompt: a proposer that
              sees other requests' outputs (suffix decoding) drafts it, a lookup in the request's own tokens
              (n-gram) cannot. (A review task does not serve: reviews quote the code, which n-gram with 15
              drafts copies as far as suffix decoding does. A JSON tool-definition task does not either:
              SmolLM2-135M does not follow it, and its answers share little.)
"""
from __future__ import annotations

import importlib
import inspect
import re
import statistics
import textwrap
import time

NGRAM = {"method": "ngram", "num_speculative_tokens": 15, "prompt_lookup_max": 4, "prompt_lookup_min": 2}  # defaults
NGRAM_K5 = {**NGRAM, "num_speculative_tokens": 5}   # a cap of 5 drafts, as vLLM users commonly set it
SUFFIX = {"method": "suffix"}
TOPICS = ("assert", "for", "while", "if", "import", "return", "pass", "global", "raise", "del", "continue", "with",
          "try", "class", "lambda", "nonlocal", "yield", "break", "assignment", "async", "atom-identifiers",
          "attribute-access", "augassign", "binary", "booleans", "calls", "comparisons", "compound",
          "context-managers", "conversions", "customization", "dict", "dynamic-features", "exceptions",
          "execmodel", "floating", "formatstrings", "function", "identifiers", "integers", "lists", "naming",
          "numeric-types", "power", "slicings", "specialnames", "strings", "subscriptions", "truth", "unary")
FUNCTIONS = ("textwrap.dedent", "textwrap.indent", "json.decoder.py_scanstring", "shutil.copyfileobj",
             "fnmatch.translate", "html.escape", "string.capwords", "shlex.quote", "urllib.parse.urljoin",
             "calendar.isleap", "difflib.get_close_matches", "shutil.which", "base64.b64encode", "glob.has_magic",
             "statistics.median", "random.shuffle", "heapq.nlargest", "tempfile.mkdtemp", "zipfile.is_zipfile",
             "colorsys.rgb_to_hsv", "textwrap.shorten", "fnmatch.filter", "statistics.mode", "random.choices",
             "copy.deepcopy", "inspect.cleandoc", "statistics.variance", "urllib.parse.quote", "shlex.split",
             "html.unescape", "heapq.merge", "dataclasses.asdict", "mimetypes.guess_type", "ipaddress.ip_address")
OPEN_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, for a curious ten-year-old.",
    "Give me ten ideas for a rainy weekend with friends.",
    "What are the pros and cons of working from home?",
    "Write a poem about the first snow of winter.",
    "Describe a perfect day in a city you would like to visit.",
    "Why do people enjoy horror films? Give a few reasons.",
    "Suggest a weekly plan for someone who wants to start running.",
    "Tell me about the history of the bicycle in a few paragraphs.",
    "Write a letter from a cat to its owner about the new dog.",
    "How could a small town attract more young people? List some ideas.",
    "Invent a board game and explain its rules.",
)


def _functions() -> list:
    """The FUNCTIONS whose source this Python has (a C implementation has none)."""
    found = []
    for path in FUNCTIONS:
        module, _, name = path.rpartition(".")
        try:
            function = getattr(importlib.import_module(module), name)
            inspect.getsource(function)
        except (ImportError, AttributeError, OSError, TypeError):
            continue
        found.append(function)
    return found


def grounded_chats(count: int) -> list[tuple[str, list[dict]]]:
    """(kind, chat) pairs: summarise / rewrite a passage of the Python language reference, or edit a
    function of the standard library, in turn; every prompt has its own passage or function (so no answer is
    in another's output), up to three times the number of functions this Python has the source of."""
    import pydoc_data.topics

    passages = []
    for name in TOPICS:
        paragraphs = [p for p in pydoc_data.topics.topics.get(name, "").split("\n\n")
                      if len(p) > 200 and "::=" not in p]
        if paragraphs:
            passages.append(" ".join(paragraphs[0].split())[:700])
    functions = [inspect.getsource(f) for f in _functions()]
    distinct = 3 * min(len(passages) // 2, len(functions))
    if count > distinct:
        raise ValueError(f"{count} grounded prompts asked for; this Python gives {distinct} distinct ones")
    chats = []
    for i in range(count):
        kind, j = ("summarise", "rewrite", "code-edit")[i % 3], i // 3
        if kind == "summarise":
            content = f"Summarise this text in a few sentences:\n\n{passages[2 * j]}"
        elif kind == "rewrite":
            content = f"Rewrite this text in simpler words, keeping every point:\n\n{passages[2 * j + 1]}"
        else:
            code = textwrap.dedent(functions[j])[:1200]
            content = f"Add a docstring and type hints to this function and show the whole function:\n\n{code}"
        chats.append((kind, [{"role": "user", "content": content}]))
    return chats


def open_chats(count: int) -> list[tuple[str, list[dict]]]:
    return [("open", [{"role": "user", "content": OPEN_PROMPTS[i % len(OPEN_PROMPTS)]}]) for i in range(count)]


REVISION_COMMENT = "# Callers rely on this behaviour; keep it stable."
REVISION_NOTE = "# Reviewed."
DOCUMENT = ("Write user documentation for this function: what it is for, its parameters, what it returns, "
            "and an example.")


def revisions(function) -> list[str]:
    """Eight revisions of `function`'s source: as written, and with each combination of a comment added at the
    top of its body, its first parameter renamed and a note appended after it."""
    code = textwrap.dedent(inspect.getsource(function))[:1200]
    lines = code.rstrip("\n").split("\n")
    body = next(i for i, line in enumerate(lines) if line.rstrip().endswith(":")) + 1   # after the signature
    indent = re.match(r"\s*", lines[body]).group(0) if body < len(lines) else "    "
    first = next(iter(inspect.signature(function).parameters), None)
    found = []
    for edits in range(8):
        text = "\n".join(lines[:body] + [indent + REVISION_COMMENT] + lines[body:] if edits & 1 else lines)
        if edits & 2 and first:
            text = re.sub(rf"\b{first}\b", first + "_value", text)
        if edits & 4:
            text += "\n" + REVISION_NOTE
        found.append(text + "\n")
    return found


def repetitive_chats(count: int) -> list[tuple[str, list[dict]]]:
    """Documentation of each revision of one function after another (`count` prompts, 8 per function)."""
    chats = []
    for function in _functions():
        for code in revisions(function):
            if len(chats) == count:
                return chats
            chats.append(("repetitive", [{"role": "user", "content": f"{DOCUMENT}\n\n{code}"}]))
    return chats


WORKLOADS = {"grounded": grounded_chats, "open": open_chats, "repetitive": repetitive_chats}
# Prompts of each workload at batch 1, in bench/spec_decode.py's compare part and in bench/spec_replay.py. With 9
# grounded prompts a run with n-gram lasted 0.27 s on an H200 and the ratios moved between machine starts by more
# than the proposers differ; with 18 it lasts 0.56 s (docs/speculative_decoding.md).
BATCH1_PROMPTS = {"grounded": 18, "open": len(OPEN_PROMPTS), "repetitive": 16}


def run_compare(args) -> dict:
    """Off, n-gram (up to 15 drafts, and up to 5) and suffix decoding on the same engine (speculation switched per
    run), for each (workload, batch) case: every prompt submitted at once with at most `batch` running, greedy.
    Modes alternate (off, ngram, ngram_k5, suffix, then the reverse) for `args.compare_rounds` rounds. A mode's speedup
    is the median over these sweeps of its tokens per second over off's in the same sweep: a run lasts about a second,
    and the machine's speed drifts over a case's sweeps by more than the modes differ (a third on one H200 start), so
    only runs close in time are compared. Before each run the prefix cache is emptied, and suffix decoding starts from
    an empty cache of other requests' outputs (so only earlier requests of the same run feed it)."""
    import torch

    from minivllm import LLM, SamplingParams
    from minivllm.spec_decode.config import SpeculativeConfig
    from minivllm.spec_decode.controller import SpeculationController

    largest = max(batch for _, _, batch, _ in args.compare_cases)
    llm = LLM(seed=0, max_model_len=args.real_max_model_len, max_num_seqs=largest, speculative_config=NGRAM,
              **args.compare_engine_options)
    engine = llm.llm_engine
    controllers = {"off": None, "ngram": engine.spec}
    for mode, config in (("ngram_k5", NGRAM_K5), ("suffix", SUFFIX)):
        controllers[mode] = SpeculationController(SpeculativeConfig.from_dict(config), engine.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.compare_max_tokens)
    for mode, controller in controllers.items():   # first-use costs (compiles, buffers) out of the timed runs
        engine.spec = controller
        llm.chat([chat for _, chat in open_chats(2)], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    # Each mode early and late in a round (off ... suffix, suffix ... off); a --quick round once each.
    order = list(controllers) + ([] if args.quick else list(reversed(controllers)))
    results = {}
    for label, workload, batch, count in args.compare_cases:
        chats = [chat for _, chat in WORKLOADS[workload](count)]
        runs: dict[str, list] = {mode: [] for mode in controllers}
        for mode in order * args.compare_rounds:
            controller = controllers[mode]
            engine.spec, engine.scheduler.config.max_num_seqs = controller, batch
            engine.block_manager.reset_prefix_cache()
            if controller is not None:
                controller.reset_stats()
                if controller.suffix is not None:
                    controller.suffix.cache.clear()
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            chained = controller.num_chained_steps if controller is not None else 0
            started = time.perf_counter()
            outputs = [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)]
            elapsed = time.perf_counter() - started
            run = {"tokens_per_s": sum(map(len, outputs)) / elapsed, "output_tokens": sum(map(len, outputs)),
                   "outputs": outputs}
            if controller is not None and controller.stats.num_drafts:
                stats = controller.stats
                run.update(num_verify=stats.num_drafts, acceptance_rate=stats.num_accepted_tokens / stats.num_draft_tokens,
                           mean_tokens_per_verify=1 + stats.num_accepted_tokens / stats.num_drafts,
                           num_chained_steps=controller.num_chained_steps - chained)
                # The device's idle after a verify step that was waited for (the controller's G, a median of its
                # last 8): what separates the verify steps of one machine start from another's.
                if controller.chaining.host_gap is not None:
                    run["device_idle_after_verify_us"] = 1e6 * controller.chaining.host_gap
            runs[mode].append(run)
        reference = runs["off"][0]["outputs"]
        case = {"workload": workload, "batch": batch, "num_prompts": count}
        for mode, mode_runs in runs.items():
            best = dict(max(mode_runs, key=lambda r: r["tokens_per_s"]))
            best["tokens_per_s_runs"] = [r["tokens_per_s"] for r in mode_runs]
            for key in ("device_idle_after_verify_us", "num_chained_steps"):
                if any(key in r for r in mode_runs):
                    best[f"{key}_runs"] = [r.get(key) for r in mode_runs]
            outputs = best.pop("outputs")
            best["outputs_identical_to_off"] = sum(a == b for a, b in zip(outputs, reference))
            # Where differing outputs part from off's (bf16: near-tie argmaxes, see WRITEUP.md section 5).
            best["first_difference_at"] = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                                           for a, b in zip(outputs, reference) if a != b]
            case[mode] = best
        off_runs = case["off"]["tokens_per_s_runs"]
        for mode in ("ngram", "ngram_k5", "suffix"):
            ratios = [run / off for run, off in zip(case[mode]["tokens_per_s_runs"], off_runs)]
            case[f"{mode}_speedup"] = statistics.median(ratios)
            case[mode]["speedup_per_sweep"] = ratios
            case[mode]["best_over_best"] = case[mode]["tokens_per_s"] / case["off"]["tokens_per_s"]
        results[label] = case
        print(f"  {workload}, batch {batch}: off {case['off']['tokens_per_s']:.0f} tok/s, n-gram "
              f"x{case['ngram_speedup']:.2f} (5 drafts x{case['ngram_k5_speedup']:.2f}), "
              f"suffix x{case['suffix_speedup']:.2f}")
    engine.spec = controllers["ngram"]
    del llm, engine
    return results
