"""Prometheus metrics with vLLM's names and meanings under the `minivllm:` prefix.

Owns a private `CollectorRegistry` (two servers in one process never collide). Engine-wide state
(running/waiting requests, KV usage, prefix-cache and token counters) is read from the engine's
stats at scrape time; per-request histograms and the finish counter are updated by a
`RequestTracker` as each request streams and finishes, which also logs one line per request.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from minivllm.outputs import RequestOutput

logger = logging.getLogger("minivllm.server.requests")

PREFIX = "minivllm:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineStatsCollector(Collector):
    """Gauges and engine-wide counters, read from the latest stats snapshot when scraped."""

    def __init__(self, get_stats: Callable[[], object], model_name: str) -> None:
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.get_stats()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Number of requests in model execution batches.", stats.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting)
        yield gauge("num_requests_swapped", "Number of requests swapped to CPU.", stats.num_swapped)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage)
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      stats.prefix_cache_hits)
        yield counter("num_preemptions", "Cumulative number of preemptions from the engine.",
                      stats.num_preemptions)
        yield counter("prompt_tokens", "Number of prefill tokens processed.", stats.num_prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.", stats.num_generation_tokens)
        if getattr(stats, "max_lora", None) is not None:   # vLLM's series: the adapters in use, as labels
            family = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                                       labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
            family.add_metric([",".join(stats.running_lora_adapters), str(stats.max_lora),
                               ",".join(stats.waiting_lora_adapters)], time.time())
            yield family
        step_times = getattr(stats, "step_times", None)
        if step_times is not None:
            def histogram(name: str, doc: str, values) -> HistogramMetricFamily:
                family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
                family.add_metric(labels, [(floatToGoString(bound), count) for bound, count in values.cumulative()],
                                  sum_value=values.sum)
                return family
            yield histogram("iteration_tokens_total", "Histogram of the number of tokens per engine step.",
                            step_times.tokens)
            if step_times.device_seconds.count:   # steps are timed (--collect-step-times or --max-itl-ms)
                yield histogram("step_device_seconds", "Histogram of each engine step's time on the device, in "
                                "seconds.", step_times.device_seconds)
                yield histogram("step_device_idle_seconds", "Histogram of the device's idle time after each engine "
                                "step until the next began, in seconds.", step_times.device_idle_seconds)
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:
            yield counter("spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens)
            family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens per draft position.", labels=["model_name", "position"])
            for position, value in enumerate(spec.accepted_per_position):
                family.add_metric([self.model_name, str(position)], value)
            yield family


class ServerMetrics:
    def __init__(self, get_stats: Callable[[], object], model_name: str) -> None:
        self.model_name = model_name
        # (monotonic time, seconds) of recent requests, for the dashboard's rolling percentiles.
        self.recent_ttft: deque[tuple[float, float]] = deque(maxlen=4096)
        self.recent_itl: deque[tuple[float, float]] = deque(maxlen=16384)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(get_stats, model_name))
        reg = self.registry

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=reg).labels(model_name)

        self.request_success = Counter(PREFIX + "request_success", "Count of finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=reg)
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Histogram of end to end request latency in seconds.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Histogram of time spent in the waiting queue in seconds.",
                                            _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Number of prefill tokens processed, per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed, per request.",
                                                   _TOKEN_BUCKETS)
        self.startup_phase = Gauge(PREFIX + "startup_phase_seconds", "Seconds each phase of the server's start "
                                   "took (api_server.StartupTimes).", ["model_name", "phase"], registry=reg)

    def set_startup_phases(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.startup_phase.labels(self.model_name, phase).set(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, request_id: str) -> RequestTracker:
        return RequestTracker(self, request_id)


class RequestTracker:
    """Follows one request's outputs: ITL as tokens arrive, the rest (and a log line) at the end."""

    def __init__(self, metrics: ServerMetrics, request_id: str) -> None:
        self.metrics = metrics
        self.request_id = request_id
        self.start = time.monotonic()
        self.last_token_time: float | None = None
        self.first_token_time: float | None = None
        self.num_tokens = 0
        self.done = False

    def on_output(self, output: RequestOutput) -> None:
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if num_tokens > self.num_tokens:
            now = time.monotonic()
            if self.last_token_time is None:
                self.first_token_time = now
            else:
                self.metrics.inter_token_latency.observe(now - self.last_token_time)
                self.metrics.recent_itl.append((now, now - self.last_token_time))
            self.last_token_time = now
            self.num_tokens = num_tokens
        if output.finished:
            self._finish(output)

    def on_close(self) -> None:
        """The stream ended; if the request did not finish it was aborted (client gone or error)."""
        if not self.done:
            self.done = True
            self.metrics.request_success.labels(self.metrics.model_name, "abort").inc()
            logger.info("request %s aborted after %d tokens, %.1f ms", self.request_id, self.num_tokens,
                        (time.monotonic() - self.start) * 1e3)

    def _finish(self, output: RequestOutput) -> None:
        self.done = True
        m = self.metrics
        now = time.monotonic()
        timing = output.metrics
        arrival = timing.arrival_time if timing is not None else self.start
        first_token = (timing.first_token_time if timing is not None else None) or self.first_token_time
        finished = (timing.finished_time if timing is not None else None) or now
        ttft = first_token - arrival if first_token is not None else None
        if ttft is not None:
            m.time_to_first_token.observe(ttft)
            m.recent_ttft.append((now, ttft))
        if timing is not None and timing.first_scheduled_time is not None:
            m.request_queue_time.observe(timing.first_scheduled_time - arrival)
        latency = finished - arrival
        m.e2e_request_latency.observe(latency)
        num_prompt = len(output.prompt_token_ids)
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        m.request_prompt_tokens.observe(num_prompt)
        m.request_generation_tokens.observe(num_generated)
        reasons = sorted({c.finish_reason or "abort" for c in output.outputs})
        for completion in output.outputs:
            m.request_success.labels(m.model_name, completion.finish_reason or "abort").inc()
        logger.info("request %s finished (%s): prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
                    "ttft=%s latency=%.1fms", self.request_id, ",".join(reasons), num_prompt, num_generated,
                    output.num_cached_tokens, f"{ttft * 1e3:.1f}ms" if ttft is not None else "n/a",
                    latency * 1e3)
