"""Per-kernel marginal times of one decoder layer, from a step profile's decode timeline.

`bench/profile_step.py --kernels` records each decode kernel's start and duration; under PDL a kernel starts
long before its predecessor ends, so its duration says little. Its marginal, its end minus the latest end
before it, is what it adds to the step. Layers are cut at each `--start` kernel (the KV write, which every layer
runs once) and the median over the layers of the most common shape is printed.

    python3 bench/kernels/layer_marginals.py step_profile_gptq.json [more files] [--label NAME ...] [--out FILE]

With `--out`, each profile's device, commit, date and command go into one JSON file beside its marginals (labels
name the variants compared); the file's own commit and date are the newest profile's.
"""
from __future__ import annotations

import argparse
import collections
import json
import shlex
import statistics
import sys


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
    parser.add_argument("--label", action="append", default=[], help="a name for each profile, in order")
    parser.add_argument("--out", default=None, help="write the marginals (with each profile's metadata) as JSON")
    args = parser.parse_args()
    rows = []
    for i, path in enumerate(args.profiles):
        with open(path) as f:
            profile = json.load(f)
        total, per_kernel, count = layer_marginals(profile["decode_kernels"]["timeline"], args.start)
        print(f"{path}: {count} layers, median layer {total:.2f} us")
        for name, marginal in per_kernel:
            print(f"  {name[:40]:40s} {marginal:6.2f}")
        rows.append({"label": args.label[i] if i < len(args.label) else path,
                     **{key: profile.get(key) for key in ("device", "commit", "date", "command", "model")},
                     "layers": count, "layer_us": round(total, 2),
                     "kernels": [{"kernel": name, "marginal_us": round(m, 2)} for name, m in per_kernel]})
    if args.out:
        with open(args.out, "w") as f:
            newest = max(rows, key=lambda row: row["date"] or "")
            json.dump({"device": newest["device"], "commit": newest["commit"], "date": newest["date"],
                       "command": shlex.join(["python3", "bench/kernels/layer_marginals.py", *sys.argv[1:]]),
                       "start": args.start, "profiles": rows}, f, indent=2)
            f.write("\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
