"""bench/cold_start.py and bench/safetensors_load.py on the CPU with the dummy tiny model: one server start
timed to /health and the first token with the server's phase breakdown, and a written checkpoint loaded back
through the parallel reader with the same tensors as the sequential one."""
from __future__ import annotations

import json

import torch

from bench import cold_start, safetensors_load
from minivllm.models import loader


def test_cold_start_reports_the_phases_and_the_first_token(tmp_path):
    report = cold_start.main(["--model", "tiny-llama", "--load-format", "dummy", "--cache-states", "warm",
                              "--server-args", "--device cpu --max-model-len 128 --kv-cache-memory 8MiB",
                              "--out", str(tmp_path), "--tag", "smoke"])
    start = report["starts"]["warm"]
    assert 0 < start["launch_to_health_s"] <= start["launch_to_first_token_s"] == report["cold_start_warm_cache_s"]
    phases = start["phases_s"]
    for phase in ("imports", "bind_socket", "engine_init", "resolve_model", "tokenizer", "load_weights",
                  "kv_cache_allocation", "build_app", "server_start", "total"):
        assert phases[phase] >= 0, phase
    # The engine's phases lie inside its init, and the whole start inside launch -> /health.
    assert phases["resolve_model"] + phases["tokenizer"] + phases["load_weights"] <= phases["engine_init"]
    assert phases["imports"] + phases["engine_init"] <= phases["total"] <= start["launch_to_health_s"] + 0.05
    assert json.loads((tmp_path / "cold_start_smoke.json").read_text())["cold_start_warm_cache_s"] > 0


def test_safetensors_bench_and_the_parallel_reader_agree(tmp_path):
    folder = tmp_path / "checkpoint"
    config = loader.CONFIGS_DIR / "tiny-llama.json"
    num_bytes = safetensors_load.write_checkpoint(folder, config, torch.float32)
    sequential = list(loader.iterate_safetensors(str(folder)))
    parallel = list(loader.iterate_safetensors(str(folder), "cpu", num_threads=3))
    assert [name for name, _ in parallel] == [name for name, _ in sequential]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(parallel, sequential))
    assert sum(t.nbytes for _, t in sequential) == num_bytes
    report = safetensors_load.main(["--model", "tiny-llama", "--device", "cpu", "--dtype", "float32",
                                    "--out", str(tmp_path), "--merge-into", str(tmp_path / "serve_cpu.json")])
    assert report["weight_bytes"] == num_bytes and report["safetensors_load_gb_s"] > 0
    assert json.loads((tmp_path / "serve_cpu.json").read_text())["safetensors_load_gb_s"] > 0
