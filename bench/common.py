"""Shared code for the benchmarks in bench/: run metadata, the device's two ceilings, model arithmetic,
percentiles and result files.

What lives here is what every benchmark needs to relate its numbers to the hardware (METHOD: measure the
copy bandwidth and the matmul rate on the device, count the bytes and FLOPs the work must do). It must
not import the engine: a benchmark of the engine, of the server or of one kernel can all use it.
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIGS_DIR = REPO_ROOT / "minivllm" / "models" / "configs"


# ---- run metadata ----------------------------------------------------------------------------------------
def add_engine_bench_args(parser) -> None:
    """--out, --device and --model of the benches that run one engine on a dummy config or the default model;
    resolve the model afterwards with `engine_bench_model`."""
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="dummy config name (default llama-3-8b; 'default' = the "
                                                      "default model's real weights, the CPU default)")


def engine_bench_model(args) -> str:
    return args.model or ("llama-3-8b" if args.device == "cuda" else "default")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100': the first word holding a digit, for file names."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w != "nvidia"]
    with_digit = [w for w in words if any(c.isdigit() for c in w)]
    return (with_digit or words or ["unknown"])[0]


def git_commit() -> str:
    """MINIVLLM_COMMIT if set (the device machine's copy has no .git), else the short HEAD, '-dirty' if the
    tree has uncommitted changes, else 'unknown'."""
    if os.environ.get("MINIVLLM_COMMIT"):
        return os.environ["MINIVLLM_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def run_command() -> str:
    """The command line that produced a result: the interpreter's name and the script's arguments as given."""
    return " ".join(["python", *sys.argv])


def run_metadata(device: torch.device) -> dict:
    """The keys every result file starts with."""
    return {"device": device_name(device), "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "command": run_command()}


# ---- timing and the two ceilings ---------------------------------------------------------------------------
def time_median(fn: Callable[[], object], device: torch.device, warmup: int = 3, repeats: int = 20) -> float:
    """Median seconds of one call of `fn`: CUDA events around each call on the GPU (device work is
    asynchronous), the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def graph_replay_us(graph: "torch.cuda.CUDAGraph", replays: int, warmup: int = 3, repeats: int = 1) -> float:
    """Device microseconds per replay of a captured CUDA graph: CUDA events around `replays` back-to-back replays
    after `warmup` untimed ones (no host time between them), the median of `repeats` such timings."""
    timings = []
    for _ in range(repeats):
        for _ in range(warmup):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        timings.append(1e3 * start.elapsed_time(end) / replays)
    return statistics.median(timings)


def measure_copy_bandwidth(device: torch.device, num_bytes: int | None = None) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written. The buffer is
    far larger than the caches (1 GiB on the GPU) and holds random data, never zeros."""
    num_bytes = num_bytes or (2**30 if device.type == "cuda" else 64 * 2**20)
    src = torch.randint(-128, 127, (num_bytes,), dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    seconds = time_median(lambda: dst.copy_(src), device)
    return 2 * num_bytes / seconds


def announced_copy_bandwidth(device: torch.device, meta: dict) -> float:
    """`measure_copy_bandwidth`, printed after the run's device and commit (the kernel sweeps' first line)."""
    copy_bw = measure_copy_bandwidth(device)
    print(f"{meta['device']} {meta['commit']} copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    return copy_bw


def checked_timing(fn, reference: torch.Tensor | None, label: str) -> tuple[float, float] | None:
    """A candidate kernel's (max |fn() - reference| / max |reference|, seconds per call from a CUDA graph), the
    error 0 without a reference; None, with the reason printed after `label`, where it cannot run on this GPU
    (shared memory, registers)."""
    from minivllm.kernels.tuning import device_seconds
    try:
        error = 0.0 if reference is None else ((fn().float() - reference).abs().max() / reference.abs().max()).item()
        return error, device_seconds(fn, calls=10, repeats=10)
    except Exception as e:
        print(f"  {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None


def measure_matmul_rate(device: torch.device, dtype: torch.dtype, n: int | None = None) -> float:
    """FLOP/s of an n x n x n matrix product on random data (8192 on the GPU)."""
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    seconds = time_median(lambda: torch.matmul(a, b, out=c), device)
    return 2 * n**3 / seconds


# ---- model arithmetic ---------------------------------------------------------------------------------------
@dataclass
class ModelShape:
    """The sizes of a Llama-family decoder that set its bytes and FLOPs (from an HF config)."""
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    bytes_per_param: int

    @classmethod
    def from_hf_config(cls, hf_config, dtype: torch.dtype) -> "ModelShape":
        num_heads = hf_config.num_attention_heads
        return cls(
            num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size, num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            vocab_size=hf_config.vocab_size,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=hf_config.model_type == "qwen3",
            bytes_per_param=torch.tensor([], dtype=dtype).element_size())

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's matrix products (q/k/v, o, gate/up, down)."""
        qkv = self.hidden_size * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        return qkv + o + 3 * self.hidden_size * self.intermediate_size

    @property
    def num_params(self) -> int:
        layer_small = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0) \
            + ((self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0)
        embedding = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embedding
        return self.num_layers * (self.layer_matmul_params + layer_small) + embedding + lm_head + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @property
    def step_weight_bytes(self) -> int:
        """Weight bytes one forward step must read: everything but an untied embedding table, of which
        only the looked-up rows are read."""
        untied_embedding = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return (self.num_params - untied_embedding) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    def matmul_flops(self, num_tokens: int, num_logits: int) -> int:
        """FLOPs of the linear layers for `num_tokens` tokens, of which `num_logits` go through the LM head."""
        return 2 * self.num_layers * self.layer_matmul_params * num_tokens \
            + 2 * self.vocab_size * self.hidden_size * num_logits

    def attention_flops(self, query_len: int, context_len: int) -> int:
        """FLOPs of QK^T and PV for `query_len` causal queries ending a context of `context_len` tokens:
        query i sees context_len - query_len + 1 + i keys."""
        keys_seen = query_len * (context_len - query_len) + query_len * (query_len + 1) // 2
        return 4 * self.num_layers * self.num_heads * self.head_dim * keys_seen


def load_hf_config(model: str):
    """The config of a shipped dummy model name (minivllm/models/configs/<name>.json) or a config path, as the
    engine reads it."""
    from minivllm.models.hf_config import read_config
    path = Path(model)
    if not path.is_file():
        path = CONFIGS_DIR / f"{model}.json"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
        raise ValueError(f"no config for model {model!r}; shipped configs: {known}")
    return read_config(path)


# ---- statistics and result files ---------------------------------------------------------------------------
def percentiles(values: list[float], points: tuple[float, ...] = (50, 90, 99)) -> dict[str, float]:
    """{'p50': ..., 'p90': ..., 'mean': ...} by linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentiles of an empty list")
    ordered = sorted(values)
    result = {}
    for p in points:
        rank = (len(ordered) - 1) * p / 100
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        result[f"p{p:g}"] = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    result["mean"] = sum(ordered) / len(ordered)
    return result


def tuner_us(*kinds: str) -> dict:
    """What the engine's tuner (kernels/tuning.py) timed so far for keys of these kinds: {key: {candidate: us}}
    (the one-row GEMV against cuBLAS per weight shape, the few-token MoE tiles against the grouped path, ...)."""
    from minivllm.kernels import tuning
    return {repr(key): {repr(candidate): 1e6 * seconds for seconds, candidate in timed}
            for key, timed in tuning.measured.items() if key[0] in kinds}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_to_json) + "\n")
    print(f"wrote {path}")


def _to_json(value):
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return str(value)


def write_csv(path: Path, rows: list[dict]) -> None:
    """Rows of one schema (the first row's keys) as CSV."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def print_table(rows: list[dict], title: str | None = None) -> None:
    """A plain fixed-width table of dicts sharing keys; floats get 4 significant digits."""
    if not rows:
        return
    keys = list(rows[0])
    cells = [[_cell(row.get(k)) for k in keys] for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    if title:
        print(f"\n{title}")
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)
