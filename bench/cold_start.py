"""Cold start of `minivllm serve`: launch -> healthy /health -> first streamed token, with the server's own
breakdown of its start (the `startup phases (s): {...}` log line of server/api_server.StartupTimes), for an
empty and a warm Triton kernel cache.

Each start gets TRITON_CACHE_DIR pointed at one fresh temporary folder: the first start ("empty") compiles
every kernel into it, the next ("warm") finds them there, as a restart of a server with a persistent cache
does. The difference between the two is Triton's compile time.

    python bench/cold_start.py --model llama-3-8b --load-format dummy --out bench/results \\
        --merge-into bench/results/serve_h100.json
    python bench/cold_start.py --model tiny-llama --load-format dummy --server-args '--device cpu' --cache-states warm
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout
from bench.common import git_commit, run_command  # noqa: E402
from bench.serve import device_name, device_tag, free_port, start_server, stop_server  # noqa: E402

PHASES_LINE = re.compile(r"startup phases \(s\): (\{.*\})")
POLL_S = 0.02


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except (urllib.error.URLError, OSError):
        return 0


def _first_token_seconds(url: str) -> float:
    """Seconds from sending a one-token streaming completion to its first token chunk."""
    body = json.dumps({"prompt": [1000, 1001, 1002, 1003], "max_tokens": 2, "stream": True, "ignore_eos": True,
                       "temperature": 0.0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]" and b'"choices"' in line:
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without a token")


def one_start(args, cache_dir: Path, log_path: Path) -> dict:
    """Launch the server, time /health and the first token, read its phases, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launched = time.perf_counter()
    process = start_server(args, port, log_path, env={"TRITON_CACHE_DIR": str(cache_dir)})
    try:
        while _get(url + "/health") != 200:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            if time.perf_counter() - launched > args.server_timeout:
                raise TimeoutError(f"no healthy /health within {args.server_timeout:.0f} s")
            time.sleep(POLL_S)
        healthy = time.perf_counter() - launched
        first_request = _first_token_seconds(url)
        first_token = time.perf_counter() - launched
    finally:
        stop_server(process)
    match = PHASES_LINE.search(log_path.read_text())
    return {"launch_to_health_s": round(healthy, 3), "launch_to_first_token_s": round(first_token, 3),
            "first_request_ttft_s": round(first_request, 4),
            "phases_s": json.loads(match.group(1)) if match else None}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model for `minivllm serve` (default: the default model)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--server-args", default="", help="extra `minivllm serve` flags")
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--cache-states", default="empty,warm",
                   help="starts in order, sharing one fresh Triton cache folder: 'empty' must come first")
    p.add_argument("--cache-dir", default=None,
                   help="Triton cache folder to use and keep (default: a fresh temporary one); must be empty for "
                        "an 'empty' start, and a 'warm' start alone then finds what earlier starts left there")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--tag", default=None, help="file name tag (default: the GPU, e.g. h100, or cpu)")
    p.add_argument("--merge-into", default=None, help="also write the top-level keys into this result file")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    states = [s.strip() for s in args.cache_states.split(",") if s.strip()]
    if not states or set(states) - {"empty", "warm"} or ("empty" in states and states[0] != "empty"):
        raise SystemExit("--cache-states: 'empty' and/or 'warm', with 'empty' first")
    device = device_name()
    tag = args.tag or device_tag(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"device: {device}\nconfig: {json.dumps(vars(args))}", flush=True)
    starts = {}
    if args.cache_dir:
        Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
        if "empty" in states and any(Path(args.cache_dir).iterdir()):
            raise SystemExit(f"--cache-dir {args.cache_dir} is not empty: no 'empty' start from it")
    with contextlib.nullcontext(args.cache_dir) if args.cache_dir else tempfile.TemporaryDirectory(
            prefix="triton-cache-") as cache_dir:
        for state in states:
            starts[state] = one_start(args, Path(cache_dir), out / f"cold_start_{tag}.{state}.server.log")
            print(f"{state} Triton cache: {json.dumps(starts[state])}", flush=True)
    report = {"device": device, "commit": git_commit(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "command": run_command(),
              "config": vars(args), "starts": starts}
    keys = {f"cold_start_{state}_cache_s": start["launch_to_first_token_s"] for state, start in starts.items()}
    report.update(keys)
    path = out / f"cold_start_{tag}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    if args.merge_into:
        target = Path(args.merge_into)
        merged = json.loads(target.read_text()) if target.exists() else {"device": device}
        merged.update(keys)
        merged["cold_start"] = {**{k: report[k] for k in ("commit", "date", "command")}, **starts}
        target.write_text(json.dumps(merged, indent=2) + "\n")
        print(f"merged {sorted(keys)} into {target}")
    return report


if __name__ == "__main__":
    main()
