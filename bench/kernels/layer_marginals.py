"""Per-kernel marginal times of one decoder layer, from a step profile's decode timeline.

`bench/profile_step.py --kernels` records each decode kernel's start and duration; under PDL a kernel starts
long before its predecessor ends, so its duration says little. Its marginal, its end minus the latest end
before it, is what it adds to the step. Layers are cut at each `--start` kernel (the KV write, which every layer
runs once) and the median over the layers of the most common shape is printed.

    python3 bench/kernels/layer_marginals.py step_profile_gptq.json [more files]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics


def layer_marginals(timeline, start: str = "_write_kv") -> tuple[float, list[tuple[str, float]], int]:
    """(median layer us, [(kernel, median marginal us)] in layer order, layers counted)."""
    rows, last = [], None
    for name, begin, duration in timeline:
        end = begin + duration
        if last is not None:
            rows.append((name, end - last))
        last = end if last is None else max(last, end)
    cuts = [i for i, (name, _) in enumerate(rows) if name.startswith(start)]
    layers = [rows[a:b] for a, b in zip(cuts, cuts[1:])]
    shape = collections.Counter(tuple(n for n, _ in layer) for layer in layers).most_common(1)[0][0]
    same = [layer for layer in layers if tuple(n for n, _ in layer) == shape]
    per_kernel = [(name, statistics.median(layer[i][1] for layer in same)) for i, name in enumerate(shape)]
    return statistics.median(sum(m for _, m in layer) for layer in same), per_kernel, len(same)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+")
    parser.add_argument("--start", default="_write_kv", help="the kernel each layer runs once, where layers are cut")
    args = parser.parse_args()
    for path in args.profiles:
        with open(path) as f:
            timeline = json.load(f)["decode_kernels"]["timeline"]
        total, per_kernel, count = layer_marginals(timeline, args.start)
        print(f"{path}: {count} layers, median layer {total:.2f} us")
        for name, marginal in per_kernel:
            print(f"  {name[:40]:40s} {marginal:6.2f}")


if __name__ == "__main__":
    main()
