"""Step histograms: the engine's accumulator (bucket edges, +Inf), their Prometheus exposition as parsed back by
prometheus_client, and the engine's timing of every step with `collect_step_times` (CPU clocks)."""
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from minivllm import LLM, SamplingParams
from minivllm.engine.step_times import StepTimes
from minivllm.server.metrics import ServerMetrics


def samples(text: str) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def test_histograms_count_at_their_upper_bounds_and_export_as_prometheus_histograms():
    times = StepTimes()
    for tokens in (1, 1, 8, 9, 300, 20000):
        times.observe_launch(tokens)
    stats = SimpleNamespace(num_running=0, num_waiting=0, num_swapped=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                            prefix_cache_hits=0, num_preemptions=0, num_prompt_tokens=0, num_generation_tokens=0,
                            step_times=times)
    text = ServerMetrics(lambda: stats, "m").render().decode()
    got = samples(text)
    bucket = "minivllm:iteration_tokens_total_bucket"
    assert got[(bucket, "1.0")] == 2 and got[(bucket, "8.0")] == 3 and got[(bucket, "16.0")] == 4
    assert got[(bucket, "256.0")] == 4 and got[(bucket, "512.0")] == 5 and got[(bucket, "+Inf")] == 6
    assert got[("minivllm:iteration_tokens_total_sum", "")] == 1 + 1 + 8 + 9 + 300 + 20000
    assert got[("minivllm:iteration_tokens_total_count", "")] == 6
    assert not any(name.startswith("minivllm:step_device") for name, _ in got)   # no step was timed
    times.observe_device(0.004, 0.0003)
    times.observe_device(0.012, -1e-6)   # clocks a hair apart: no negative idle
    got = samples(ServerMetrics(lambda: stats, "m").render().decode())
    assert got[("minivllm:step_device_seconds_bucket", "0.005")] == 1
    assert got[("minivllm:step_device_seconds_bucket", "0.015")] == 2
    assert got[("minivllm:step_device_idle_seconds_bucket", "0.0001")] == 1
    assert got[("minivllm:step_device_idle_seconds_bucket", "0.0005")] == 2
    assert abs(got[("minivllm:step_device_seconds_sum", "")] - 0.016) < 1e-12


def test_the_engine_times_every_step_only_when_asked():
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(200 + i, 230 + i))} for i in range(3)]
    for collect in (False, True):
        llm = LLM(kv_cache_memory=64 << 20, max_model_len=512, seed=0, async_scheduling=True,
                  collect_step_times=collect)
        llm.generate(prompts, params, use_tqdm=False)
        engine = llm.llm_engine
        times = engine.step_times
        # Every scheduled token is in the token histogram: the prompts and five decodes of each request.
        assert times.tokens.sum == 3 * 30 + 3 * 5
        if not collect:
            assert times.device_seconds.count == 0
            continue
        # Each step but the last is priced when the step after it is read back.
        assert times.device_seconds.count == times.tokens.count - 1
        assert times.device_seconds.sum > 0 and times.device_idle_seconds.count == times.device_seconds.count
        assert engine.get_stats().step_times is times
