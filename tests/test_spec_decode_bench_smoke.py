"""bench/spec_decode.py --quick on the CPU: off / n-gram / suffix decoding compared on the real default
model, the load part and the idle-speculator part write the keys the speculation results are read by."""
from __future__ import annotations

import json

import pytest

from bench.spec_decode import main

KEYS = ("grounded_b1_speedup", "open_b1_speedup", "grounded_b8_speedup", "grounded_b32_speedup", "w1_load_ratio",
        "suffix_repetitive_b1_speedup", "ngram_repetitive_b1_speedup")


@pytest.mark.long
def test_quick_run_writes_every_acceptance_key(tmp_path):
    main(["--quick", "--parts", "compare,load,idle", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "spec_decode_cpu.json").read_text())
    for key in ("device", "commit", "date"):
        assert isinstance(result[key], str) and result[key]
    for key in KEYS:
        assert result[key] > 0, key
    for label, case in result["compare"].items():
        for mode in ("ngram", "ngram_k5", "suffix"):   # fp32 on the CPU: greedy speculation is exact
            assert case[mode]["outputs_identical_to_off"] == case["num_prompts"], (label, mode)
    # The controller may turn drafts off on the CPU, where verify rows cost like any others, but not before
    # trying them: its start is optimistic.
    assert any(case[mode].get("num_verify", 0) for case in result["compare"].values() for mode in ("ngram", "suffix"))
    assert {row["method"] for row in result["idle_host_cost"]["rows"]} == {"ngram", "suffix"}
    for case in result["compare"].values():   # one sweep: the speedup is that sweep's ratio to off
        assert case["suffix"]["speedup_per_sweep"] == [case["suffix_speedup"]]
