"""bench/models_bench.py end to end on the CPU (tiny GPT-2 and Qwen3-MoE configs, quick sizes, the MoE
kernel under the Triton interpreter), and the expert-touch arithmetic behind its MoE floor."""
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from bench.common import load_hf_config  # noqa: E402
from bench.models_bench import StepCost, main  # noqa: E402
from tests.conftest import tiny_hf_config  # noqa: E402


@pytest.mark.long
def test_models_bench_quick_writes_every_section(tmp_path):
    paths = []
    for arch in ("gpt2", "qwen3-moe"):
        path = tmp_path / f"{arch}.json"
        tiny_hf_config(arch).to_json_file(str(path))
        paths.append(str(path))
    main(["--device", "cpu", "--quick", "--models", ",".join(paths), "--out", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "models_cpu.json").read_text())
    for key in ("device", "commit", "date"):
        assert isinstance(result[key], str) and result[key]
    for path in paths:
        model = result["models"][path]
        assert "error" not in model, model
        for section in ("w1", "single_stream", "batch8"):
            assert model[section]["outputs_verified"] is True
            assert model[section]["achieved_over_floor"] > 0
        assert model["weight_bytes_loaded"] > 0
    kernel = result["moe_kernel"]
    assert [row["tokens"] for row in kernel] == [1, 7]
    assert all(row["max_abs_diff_vs_looped"] < 1e-4 and row["floor_us"] > 0 for row in kernel)
    assert result["moe_kernel_m7_tflops_after_models"] > 0   # the largest row timed again after the models
    # 8-bit weights, experts included: about half the bytes loaded, keyed by the format
    main(["--device", "cpu", "--quick", "--models", paths[1], "--quantization", "fp8", "--skip-kernel",
          "--out", str(tmp_path / "fp8")])
    fp8 = json.loads((tmp_path / "fp8" / "models_cpu.json").read_text())["models"][f"{paths[1]}-fp8"]
    assert "error" not in fp8, fp8
    assert fp8["weight_bytes_loaded"] < 0.75 * result["models"][paths[1]]["weight_bytes_loaded"]


def test_moe_step_cost_counts_touched_experts():
    cost = StepCost.of_model(load_hf_config("qwen3-30b-a3b"), torch.bfloat16)
    assert (cost.num_moe_layers, cost.num_experts, cost.top_k) == (48, 128, 8)
    assert cost.expert_params == 3 * 2048 * 768
    assert cost.expected_experts(1) == pytest.approx(8)
    assert 8 < cost.expected_experts(64) < 128 and cost.expected_experts(10**6) == pytest.approx(128)
    # One token reads the dense weights plus 8 experts per layer: about 3.3 B params, not 30.5 B.
    single_step_params = cost.weight_bytes(1) / 2
    assert 3.0e9 < single_step_params < 3.6e9
    dense = StepCost.of_model(load_hf_config("gpt2"), torch.float32)
    assert dense.num_moe_layers == 0 and dense.weight_bytes(1) == dense.weight_bytes(64)
