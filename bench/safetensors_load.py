"""Checkpoint loading speed: write a safetensors folder of a Llama-family config's shapes (HF tensor names,
seeded random bf16 values, shards of about 5 GB with an index, as HF writes them), evict it from the page
cache, and time `load_model` from that folder into device memory, in GB/s of weights (twice, each after
evicting the folder again; the faster load counts), against the disk's own rate (the files read in chunks
by one thread and by the loader's number of threads into buffers that are thrown away) and against
safetensors' own reader taking each tensor to the device in turn.

    python bench/safetensors_load.py --model llama-3-8b --out bench/results --merge-into bench/results/serve_h100.json
    python bench/safetensors_load.py --model tiny-llama --device cpu --out /tmp/out      # smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout
from bench.common import CONFIGS_DIR, device_slug, run_metadata  # noqa: E402
from minivllm.models import loader  # noqa: E402
from minivllm.models.hf_config import read_config  # noqa: E402
from minivllm.models.safetensors_reader import READ_THREADS  # noqa: E402

SHARD_BYTES = 5 * 10**9


def hf_llama_shapes(hf) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Llama-family checkpoint."""
    hidden, inter = hf.hidden_size, hf.intermediate_size
    head_dim = getattr(hf, "head_dim", None) or hidden // hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    q, kv = hf.num_attention_heads * head_dim, num_kv_heads * head_dim
    shapes = {"model.embed_tokens.weight": (hf.vocab_size, hidden)}
    for i in range(hf.num_hidden_layers):
        layer = f"model.layers.{i}."
        shapes |= {layer + "self_attn.q_proj.weight": (q, hidden), layer + "self_attn.k_proj.weight": (kv, hidden),
                   layer + "self_attn.v_proj.weight": (kv, hidden), layer + "self_attn.o_proj.weight": (hidden, q),
                   layer + "mlp.gate_proj.weight": (inter, hidden), layer + "mlp.up_proj.weight": (inter, hidden),
                   layer + "mlp.down_proj.weight": (hidden, inter), layer + "input_layernorm.weight": (hidden,),
                   layer + "post_attention_layernorm.weight": (hidden,)}
    shapes["model.norm.weight"] = (hidden,)
    if not getattr(hf, "tie_word_embeddings", False):
        shapes["lm_head.weight"] = (hf.vocab_size, hidden)
    return shapes


def write_checkpoint(folder: Path, config_path: Path, dtype: torch.dtype, seed: int = 0) -> int:
    """Write the folder; returns its tensor bytes."""
    from safetensors.torch import save_file
    hf = read_config(config_path)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_path, folder / "config.json")
    generator = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, shape in hf_llama_shapes(hf).items():
        tensor = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
        if size and size + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map |= {name: file for name in shard}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    return total


def evict_from_page_cache(folder: Path) -> bool:
    """Drop the folder's pages from the page cache (flushed first), so a load reads the disk."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def disk_read_rate(folder: Path, threads: int, chunk_bytes: int = 32 << 20) -> float:
    """Bytes per second of reading the folder's files from the disk (page cache evicted first) in chunks by
    `threads` threads into buffers that are thrown away: what the disk gives, the floor of a load's time."""
    evict_from_page_cache(folder)
    parts = [(path, start) for path in sorted(folder.glob("*.safetensors"))
             for start in range(0, path.stat().st_size, chunk_bytes)]
    local = threading.local()

    def read(part) -> int:
        path, start = part
        if getattr(local, "buffer", None) is None:
            local.buffer = bytearray(chunk_bytes)
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            return f.readinto(local.buffer)
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, parts))
    return total / (time.perf_counter() - started)


def safe_open_rate(folder: Path, device: torch.device) -> float:
    """Bytes per second of safetensors' own reader taking every tensor of the folder to the device, one after
    another (page cache evicted first): the reference the loader is judged against in the same run."""
    from safetensors import safe_open
    torch.zeros(1, device=device)   # the device's context is set up before the clock starts
    evict_from_page_cache(folder)
    total, started = 0, time.perf_counter()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name).to(device)
                total += tensor.nbytes
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return total / (time.perf_counter() - started)


def timed_load(folder: Path, dtype: torch.dtype, device: torch.device) -> float:
    source = loader.resolve_model(str(folder), "safetensors")
    started = time.perf_counter()
    model = loader.load_model(source, dtype, device, "safetensors")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    del model
    return seconds


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", help="a shipped Llama-family config name or a config.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--folder", default=None, help="where to write the checkpoint (default: a temporary folder)")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--merge-into", default=None, help="also write safetensors_load_gb_s into this result file")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config_path = Path(args.model) if Path(args.model).is_file() else CONFIGS_DIR / f"{args.model}.json"
    meta = run_metadata(device)
    print(f"device: {meta['device']}\nconfig: {json.dumps(vars(args))}", flush=True)
    with tempfile.TemporaryDirectory(prefix="safetensors-bench-", dir=args.folder) as tmp:
        folder = Path(tmp) / "checkpoint"
        started = time.perf_counter()
        num_bytes = write_checkpoint(folder, config_path, dtype)
        write_s = time.perf_counter() - started
        disk = {f"threads_{n}": round(disk_read_rate(folder, n) / 1e9, 3) for n in (1, READ_THREADS)}
        print(f"disk reads (GB/s): {disk}", flush=True)
        reference = round(safe_open_rate(folder, device) / 1e9, 3)
        print(f"safe_open, tensor by tensor to the device: {reference} GB/s", flush=True)
        loads = []
        for _ in range(2):   # the faster kept: the first load also pays one-time imports and set-up
            evicted = evict_from_page_cache(folder)
            seconds = timed_load(folder, dtype, device)
            print(f"load: {num_bytes / 1e9:.2f} GB in {seconds:.2f} s = {num_bytes / seconds / 1e9:.3f} GB/s", flush=True)
            loads.append({"seconds": round(seconds, 3), "gb_per_s": round(num_bytes / seconds / 1e9, 3),
                          "page_cache_evicted": evicted})
    report = {**meta, "model": args.model, "dtype": args.dtype, "weight_bytes": num_bytes,
              "write_seconds": round(write_s, 3), "disk_read_gb_s": disk, "safe_open_gb_s": reference, "loads": loads,
              "safetensors_load_gb_s": max(load["gb_per_s"] for load in loads)}
    report["load_over_disk"] = round(report["safetensors_load_gb_s"] / max(disk.values()), 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"safetensors_load_{device_slug(meta['device'])}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    if args.merge_into:
        target = Path(args.merge_into)
        merged = json.loads(target.read_text()) if target.exists() else {"device": meta["device"]}
        merged["safetensors_load_gb_s"] = report["safetensors_load_gb_s"]
        merged["safetensors_load"] = {"commit": meta["commit"], "date": meta["date"], "model": args.model,
                                      "weight_bytes": num_bytes, "disk_read_gb_s": disk, "safe_open_gb_s": reference,
                                      "loads": loads,
                                      "load_over_disk": report["load_over_disk"]}
        target.write_text(json.dumps(merged, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
