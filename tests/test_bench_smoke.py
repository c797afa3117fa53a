"""bench/throughput.py end to end on the CPU (tiny-llama, quick sizes), and the arithmetic behind its floor."""
from __future__ import annotations

import csv
import json
import types

import pytest
import torch

from bench.common import ModelShape, device_slug, load_hf_config, percentiles
from bench.throughput import QUICK, Workload, floor_output_tokens_per_s, main, timed_generate


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    results = main(["--device", "cpu", "--quick", "--sweeps", "--ablation", "--out", str(out)])
    return out, results


def test_w1_json_has_the_acceptance_keys_and_verified_counts(bench_run):
    out, _ = bench_run
    w1 = json.loads((out / "throughput_w1_cpu.json").read_text())
    for key in ("device", "commit", "date"):
        assert isinstance(w1[key], str) and w1[key]
    for key in ("output_tokens_per_s", "total_tokens_per_s", "peer_output_tokens_per_s", "floor_output_tokens_per_s",
                "ratio_over_peer", "achieved_over_floor", "copy_bandwidth_bytes_per_s", "matmul_flops_per_s"):
        assert w1[key] > 0, key
    assert w1["device"] == "cpu"
    assert w1["outputs_verified"] is True and w1["single_stream"]["outputs_verified"] is True
    # Prompt and output tokens add up to the workload: 4 x 32 -> 8.
    assert w1["run"]["num_output_tokens"] == QUICK.w1.num_requests * QUICK.w1.output_len
    assert w1["run"]["num_prompt_tokens"] == QUICK.w1.num_requests * QUICK.w1.prompt_len
    assert w1["total_tokens_per_s"] > w1["output_tokens_per_s"]
    # Random prompts must not hit the prefix cache, or the timed run would skip prefill work.
    assert w1["run"]["num_cached_tokens"] == 0
    single = w1["single_stream"]
    assert single["ms_per_token"] > 0 and single["tokens_per_s"] == pytest.approx(1e3 / single["ms_per_token"])
    assert single["floor_tokens_per_s"] > 0
    kv = w1["kv_cache"]
    assert kv["tokens"] == kv["num_blocks"] * kv["block_size"] > 0
    assert 0 < kv["fraction_of_budget"] <= 1 and kv["kv_bytes"] <= kv["budget_bytes"]


def test_config_arithmetic_matches_the_engine_weights(bench_run):
    out, _ = bench_run
    w1 = json.loads((out / "throughput_w1_cpu.json").read_text())
    assert w1["weight_bytes_loaded"] == w1["weight_bytes"]
    assert w1["kv_bytes_per_token"] * w1["kv_cache"]["tokens"] == w1["kv_cache"]["kv_bytes"]


def test_sweep_csv_png_and_ablation(bench_run):
    out, results = bench_run
    with (out / "throughput_sweep_cpu.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(QUICK.sweep_batches) + len(QUICK.sweep_lengths)
    assert [int(r["batch"]) for r in rows if r["sweep"] == "batch"] == list(QUICK.sweep_batches)
    assert all(float(r["output_tokens_per_s"]) > 0 and float(r["floor_output_tokens_per_s"]) > 0 for r in rows)
    assert (out / "throughput_sweep_cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ablation = json.loads((out / "ablation_cpu.json").read_text())
    assert ablation["rows"] and all(r["output_tokens_per_s"] > 0 for r in ablation["rows"])
    assert ablation["rows"][0]["attention_backend"] == "torch"
    assert set(results) == {"w1", "sweeps", "ablation"}


def test_timed_generate_rejects_wrong_token_counts():
    # A stand-in engine whose second request stops early: the benchmark must refuse to report it.
    def fake_output(n):
        metrics = types.SimpleNamespace(arrival_time=0.0, first_token_time=1.0, finished_time=2.0)
        return types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[7] * n)], metrics=metrics,
                                     num_cached_tokens=0)
    fake_llm = types.SimpleNamespace(generate=lambda prompts, params, use_tqdm: [fake_output(4), fake_output(3)])
    with pytest.raises(RuntimeError, match="did not produce 4 tokens"):
        timed_generate(fake_llm, [[1, 2], [3, 4]], 4)
    fake_llm.generate = lambda prompts, params, use_tqdm: [fake_output(4), fake_output(4)]
    assert timed_generate(fake_llm, [[1, 2], [3, 4]], 4)["num_output_tokens"] == 8


def test_llama3_8b_floor_matches_the_issue_figures():
    # At the design's H100 numbers (3.0 TB/s copy, 790 TFLOP/s bf16) the issue puts W1's floor near 7,000 tok/s.
    shape = ModelShape.from_hf_config(load_hf_config("llama-3-8b"), torch.bfloat16)
    assert shape.num_params == 8_030_261_248          # Meta's published count for Llama-3-8B
    assert shape.kv_bytes_per_token == 128 * 1024     # 32 layers x 2 x 8 heads x 128 x 2 bytes
    floor = floor_output_tokens_per_s(shape, Workload(64, 512, 256), 3.0e12, 790e12)
    assert 6_500 < floor < 7_500
    # Batch 1 decode is all weight reads: about 15 GB (the embedding table is only gathered) at 3 TB/s.
    single = floor_output_tokens_per_s(shape, Workload(1, 512, 2), 3.0e12, float("inf"))
    assert single == pytest.approx(2 / (shape.step_weight_bytes * 2 / 3.0e12), rel=0.05)


def test_attention_flops_counts_causal_pairs():
    shape = ModelShape.from_hf_config(load_hf_config("tiny-llama"), torch.float32)
    per_pair = 4 * shape.num_layers * shape.num_heads * shape.head_dim
    for query_len, context_len in [(1, 1), (1, 9), (5, 5), (3, 11)]:
        pairs = sum(1 for q in range(context_len - query_len, context_len) for k in range(context_len) if k <= q)
        assert shape.attention_flops(query_len, context_len) == per_pair * pairs


def test_percentiles_and_slug():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    result = percentiles(values, (0, 50, 90, 100))
    assert result["p0"] == 1.0 and result["p50"] == 3.0 and result["p100"] == 5.0
    assert result["p90"] == pytest.approx(4.6) and result["mean"] == 3.0
    with pytest.raises(ValueError):
        percentiles([])
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("cpu") == "cpu"


def test_layer_marginals_cut_layers_and_charge_each_kernel_what_it_adds():
    """bench/kernels/layer_marginals.py: a kernel's marginal is its end minus the latest end before it (PDL overlaps
    starts), layers are cut at the KV write, and a layer of another shape (the last, cut short) is left out."""
    from bench.kernels.layer_marginals import layer_marginals
    timeline = [("embed", 0.0, 2.0)]
    start = 2.0
    for layer in range(4):   # write_kv 1 us; the GEMV launched early (0.5 us in) ends 3 us after it; the norm 0.5
        timeline += [("_write_kv_kernel", start, 1.0), ("_gemv", start + 0.5, 3.5), ("_norm", start + 4.0, 0.5)]
        if layer == 0:
            timeline.append(("_sample", start + 4.5, 2.0))   # another shape: left out
            start += 2.0
        start += 4.5
    timeline += [("_write_kv_kernel", start, 1.0)]
    total, per_kernel, count = layer_marginals(timeline)
    assert count == 3 and per_kernel == [("_write_kv_kernel", 1.0), ("_gemv", 3.0), ("_norm", 0.5)]
    assert total == 4.5


def test_step_tile_search_names_the_one_row_gemv_keys():
    """bench/kernels/step_tile_search.py finds a Llama-3-8B layer's four one-row GEMVs among the tuner's keys (as
    int4_gemm builds them: plain (N, K) after the M bucket; the fused ones by name, with the norm's suffix)."""
    from bench.kernels.step_tile_search import as_choice, layer_of
    assert layer_of(("weight_only", "bf16", 4, 128, 1, 4096, 4096)) == "o_proj"
    assert layer_of(("weight_only", "bf16", 4, 128, 1, 4096, 14336)) == "down_proj"
    assert layer_of(("weight_only", "bf16", 4, 128, 64, 4096, 4096)) is None   # W1's batch, not one row
    assert layer_of(("weight_only_rotary", "bf16", 128, 6144, 4096, 128, "add and norm")) == "qkv_proj"
    assert layer_of(("weight_only_silu_and_mul", "bf16", 128, 28672, 4096, "norm")) == "gate_up_proj"
    assert as_choice(("weight_only",), "tile") == ("tile", 1) and as_choice(("weight_only_rotary",), "tile") == "tile"


def test_lora_bench_writes_the_acceptance_keys(tmp_path):
    from bench.lora_bench import main as lora_main
    result = lora_main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "lora_cpu.json").read_text())
    for key in ("base_w1_out_tok_s", "lora8_w1_out_tok_s", "lora8_over_base_w1", "base_single_tok_s",
                "lora_single_tok_s", "lora_single_over_base"):
        assert written[key] > 0 and written[key] == pytest.approx(result[key]), key
    assert written["device"] == "cpu" and written["commit"] and written["date"] and written["command"]
    assert written["runs"]["lora"]["w1"]["outputs_verified"] is True
