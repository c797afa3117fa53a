"""bench/serve.py's rate sweep on the CPU against two in-process servers of a dummy tiny model (a baseline and
one with an ITL target): per-rate percentiles and SLO attainment, goodput, the acceptance keys, the plot, and
goodput as its definition gives it on hand-made levels."""
from __future__ import annotations

import json

from bench.goodput import SLO, goodput, rate_keys
from bench.serve import RequestResult, main
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncEngine
from minivllm.server.api_server import ServerThread, build_app


def _server(**options) -> ServerThread:
    engine = AsyncEngine.from_config(EngineConfig(model="tiny-llama", load_format="dummy", device="cpu",
                                                  max_model_len=128, kv_cache_memory=8 << 20, **options))
    return ServerThread(build_app(engine))


def test_rate_sweep_reports_goodput_keys_and_plot(tmp_path):
    with _server() as baseline_url, _server(max_itl_ms=50.0) as url:
        main(["--url", url, "--baseline-url", baseline_url, "--request-rate", "8,20", "--num-prompts", "6",
              "--input-len", "24", "--output-len", "4", "--warmup", "1", "--tag", "smoke", "--out", str(tmp_path),
              "--slo-ttft-ms", "60000", "--slo-itl-p95-ms", "60000"])
    report = json.loads((tmp_path / "serve_smoke.json").read_text())
    for run in (report, report["baseline"]):
        levels = run["request_rate"]
        assert set(levels) == {"8.0", "20.0"}
        for level in levels.values():
            assert level["completed"] == 6 and level["failed"] == 0 and level["slo_attainment"] == 1.0
            assert level["ttft_ms"]["p50"] <= level["ttft_ms"]["p95"] <= level["ttft_ms"]["p99"]
            # The level's steps from the server's histograms: each prompt once and three decodes a request, in at
            # least one request's four steps (requests that overlap share steps).
            steps = level["engine_steps"]
            assert steps["tokens"] == 6 * (24 + 3) and steps["steps"] >= 1 + 3
            # Only the target's server times its steps on the device (its cost model needs them); a step is
            # priced once the next is read back, so not the last before the engine runs dry.
            if run is report:
                assert 0 < steps["timed_steps"] < steps["steps"] and steps["device_ms_per_step"] > 0
                assert 0.0 <= steps["idle_share"] <= 1.0
            else:
                assert "timed_steps" not in steps
        # A generous SLO is met at every rate: goodput is the highest swept rate.
        assert run["goodput_rps"] == 20.0
        for key in ("rate8_itl_p95_ms", "rate8_ttft_p50_ms", "rate20_itl_p95_ms", "rate20_itl_p99_ms",
                    "rate20_ttft_p95_ms"):
            assert run[key] > 0, key
    assert report["goodput_ratio_over_baseline"] == 1.0
    assert (tmp_path / "serve_smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goodput_and_the_slo_per_request():
    slo = SLO(ttft_ms=200, itl_p95_ms=25, min_fraction=0.9)
    fast = RequestResult(ok=True, ttft=0.1, itl=[0.01] * 40)
    # 2 of 40 gaps over the bound leave the p95 inside; 3 do not. A late first token or a failure misses.
    assert slo.met_by(fast.ok, fast.ttft, [0.01] * 38 + [0.1] * 2)
    assert not slo.met_by(True, 0.1, [0.01] * 37 + [0.1] * 3)
    assert not slo.met_by(True, 0.25, [0.01]) and not slo.met_by(False, 0.1, [])
    levels = {"2.0": {"slo_attainment": 1.0}, "8.0": {"slo_attainment": 0.95}, "20.0": {"slo_attainment": 0.5},
              "inf": {"slo_attainment": 1.0}}
    assert goodput(levels, slo) == 8.0
    assert goodput({"2.0": {"slo_attainment": 0.5}}, slo) is None
    stats = {"ttft_ms": {"p50": 1.0, "p95": 2.0}, "itl_ms": {"p95": 3.0, "p99": 4.0}}
    assert rate_keys({"8.0": stats}) == {"rate8_itl_p95_ms": 3.0, "rate8_ttft_p50_ms": 1.0}


def test_server_overhead_streams_every_token_of_both_rounds(tmp_path):
    """bench/server_overhead.py: the paced engine's tokens all reach the clients in both rounds, and the event
    loop's CPU time is split into a per-request and a per-token part."""
    from bench import server_overhead
    report = server_overhead.main(["--concurrency", "6", "--output-len", "16", "--step-ms", "2",
                                   "--out", str(tmp_path), "--tag", "smoke"])
    assert json.loads((tmp_path / "server_overhead_smoke.json").read_text()) == report
    for output_len, run in report["rounds"].items():
        assert run["completed"] == 6 and run["tokens"] == 6 * int(output_len)
        assert run["steps"] >= int(output_len) and run["achieved_step_ms"] >= 2.0
        assert run["event_loop_cpu_s"] > 0
    assert report["event_loop_cpu_us_per_request"] > 0
