"""bench/soak.py end to end, briefly: a few clients for a few seconds with token-id prompts (the mode the
GPU stage uses) and a pool small enough to preempt. The result file must report no 5xx, no crash, no
leaked blocks and a drained exit; the GPU suite then runs the same script for minutes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.long
def test_soak_smoke(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "soak.py"), "--clients", "6", "--duration-s", "4",
               "--max-tokens", "12", "--probe-tokens", "8", "--max-model-len", "256", "--kv-cache-memory", "12MiB",
               "--token-id-prompts", "--tag", "smoke", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    record = json.loads((tmp_path / "soak_smoke.json").read_text())
    assert record["requests_served"] > 0 and record["http_5xx"] == 0 and not record["server_crashed"]
    assert record["kv_blocks_leaked"] == 0 and record["server_exit_code"] == 0
    assert record["requests_disconnected"] > 0 and record["greedy_probes"].get("identical", 0) > 0
