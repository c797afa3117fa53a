"""bench/cold_start.py and bench/safetensors_load.py on the CPU with the dummy tiny model: one server start
timed to /health and the first token with the server's phase breakdown, and a written checkpoint of the
config's shapes loaded back and timed."""
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
    for phase in ("imports", "bind_socket", "engine_imports", "engine_init", "resolve_model", "tokenizer", "load_weights",
                  "kv_cache_allocation", "build_app", "server_start", "total"):
        assert phases[phase] >= 0, phase
    # The engine's phases lie inside its init, and the whole start inside launch -> /health.
    assert phases["resolve_model"] + phases["tokenizer"] + phases["load_weights"] <= phases["engine_init"]
    assert phases["imports"] + phases["engine_imports"] + phases["engine_init"] <= phases["total"] <= start["launch_to_health_s"] + 0.05
    assert json.loads((tmp_path / "cold_start_smoke.json").read_text())["cold_start_warm_cache_s"] > 0


def test_the_safetensors_bench_writes_every_weight_of_the_config_and_loads_it(tmp_path):
    folder = tmp_path / "checkpoint"
    config = loader.CONFIGS_DIR / "tiny-llama.json"
    num_bytes = safetensors_load.write_checkpoint(folder, config, torch.float32)
    tensors = dict(loader.iterate_safetensors(str(folder)))
    model = loader.load_model(loader.resolve_model(str(folder), "safetensors"), torch.float32, torch.device("cpu"))
    assert sum(t.nbytes for t in tensors.values()) == num_bytes
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    report = safetensors_load.main(["--model", "tiny-llama", "--device", "cpu", "--dtype", "float32",
                                    "--out", str(tmp_path), "--merge-into", str(tmp_path / "serve_cpu.json")])
    assert report["weight_bytes"] == num_bytes and report["safetensors_load_gb_s"] > 0
    assert len(report["disk_read_gb_s"]) == 2 and min(report["disk_read_gb_s"].values()) > 0
    assert report["safe_open_gb_s"] > 0
    assert json.loads((tmp_path / "serve_cpu.json").read_text())["safetensors_load_gb_s"] > 0
