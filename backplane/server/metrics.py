"""Prometheus metrics of the server: engine load, latencies and token counters.

Every metric lives in the server's own registry (not prometheus_client's
global one), so several servers or tests in one process do not collide.
Gauges of the engine's load are read from :meth:`AsyncLLM.snapshot` at scrape
time; latencies and token counts are recorded when a request finishes (on the
engine loop, through :meth:`AsyncLLM.add_finished_callback`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from backplane.api.async_llm import AsyncLLM
from backplane.api.outputs import RequestOutput

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

#: The text exposition format's content type.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


class _LoadCollector:
    """Gauges and counters read from the engine's last snapshot at scrape time."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        snap = self.engine.snapshot()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("backplane_num_requests_running", "Requests holding KV pages.", snap.running)
        yield gauge(
            "backplane_num_requests_waiting", "Requests waiting for admission.", snap.waiting
        )
        yield gauge(
            "backplane_kv_cache_pages_used", "KV-cache pages held by requests.", snap.kv_pages_used
        )
        yield gauge("backplane_kv_cache_pages_total", "Usable KV-cache pages.", snap.kv_pages_total)
        yield gauge(
            "backplane_kv_cache_usage_ratio",
            "Fraction of usable KV-cache pages held by requests.",
            snap.kv_pages_used / snap.kv_pages_total if snap.kv_pages_total else 0.0,
        )
        yield gauge(
            "backplane_prefix_cache_hit_rate",
            "Prompt pages found in the prefix cache over pages looked up.",
            snap.prefix_cache_hit_rate,
        )
        yield counter(
            "backplane_prefix_cache_queries",
            "Full prompt pages looked up.",
            snap.prefix_cache_queries,
        )
        yield counter(
            "backplane_prefix_cache_hits",
            "Prompt pages found (device or host tier).",
            snap.prefix_cache_hits,
        )
        yield gauge("backplane_engine_alive", "1 while the engine loop runs.", float(snap.alive))


class ServerMetrics:
    """The server's metrics registry.

    :param engine: the engine whose load and finished requests are reported.
    :param model_name: the ``model_name`` label.
    """

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        label = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram(
            "backplane_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            label,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.itl = Histogram(
            "backplane_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            label,
            buckets=_ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e = Histogram(
            "backplane_e2e_request_latency_seconds",
            "Time from arrival to the end of a request.",
            label,
            buckets=_E2E_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "backplane_prompt_tokens", "Prompt tokens of finished requests.", label, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "backplane_generation_tokens",
            "Generated tokens of finished requests.",
            label,
            registry=reg,
        ).labels(model_name)
        self.spec_verify_steps = Counter(
            "backplane_spec_decode_verify_steps",
            "Speculative decoding: sequence steps that verified draft tokens (finished requests).",
            label,
            registry=reg,
        ).labels(model_name)
        self.spec_draft_tokens = Counter(
            "backplane_spec_decode_draft_tokens",
            "Speculative decoding: draft tokens verified (finished requests).",
            label,
            registry=reg,
        ).labels(model_name)
        self.spec_accepted_tokens = Counter(
            "backplane_spec_decode_accepted_tokens",
            "Speculative decoding: draft tokens accepted (finished requests); over "
            "draft_tokens the acceptance rate, over verify_steps plus one the mean "
            "accepted length.",
            label,
            registry=reg,
        ).labels(model_name)
        self._requests = Counter(
            "backplane_requests_finished",
            "Finished requests by finish reason.",
            ["model_name", "finish_reason"],
            registry=reg,
        )
        reg.register(_LoadCollector(engine, model_name))
        engine.add_finished_callback(self.on_finished)

    def on_finished(self, out: RequestOutput) -> None:
        """Record a finished request's latencies and token counts."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(o.token_ids) for o in out.outputs))
        self._requests.labels(self.model_name, out.finish_reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.spec_verify_steps:
            self.spec_verify_steps.inc(m.spec_verify_steps)
            self.spec_draft_tokens.inc(m.spec_draft_tokens)
            self.spec_accepted_tokens.inc(m.spec_accepted_tokens)

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
