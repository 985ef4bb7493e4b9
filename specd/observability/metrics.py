"""Prometheus metrics, one CollectorRegistry per service (three services may share a process).

Speculation is counted as vLLM counts it, under the `specd_` prefix, on the coordinator
(which sees every round): a draft is a round that proposed >= 1 token; mean acceptance
length = 1 + accepted / drafts. prometheus_client appends `_total` to counter names, so
`Counter("specd_spec_decode_num_drafts")` is exposed as specd_spec_decode_num_drafts_total.
Requests are counted by outcome as vLLM names them (specd_request_success_total{finished_reason},
with specd_request_failure_total{code} for the rest), each request once; docs/observability.md
lists every metric.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from specd.observability.metrics_server import start_metrics_server

log = logging.getLogger(__name__)

# Seconds; spans CPU tiny-model latencies (ms) up to long generations (minutes).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Sessions in one forward: powers of two up to the workers' default --max-sessions (64) and past it.
_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServiceMetrics:
    """A registry and, once `serve` is called, its /metrics HTTP endpoint."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.port: int | None = None
        self._server = None

    def serve(self, host: str, port: int) -> int | None:
        """Expose /metrics on host:port (0: a free port; -1: not at all; other paths: 404);
        returns the port."""
        if port < 0:
            return None
        self._server = start_metrics_server(host, port, self.registry)
        self.port = self._server.server_port
        return self.port

    def serve_for(self, service, host: str, port: int) -> None:
        """Serve /metrics for a specd.serving.server.RunningService, stopped with it."""
        service.metrics = self
        if self.serve(host, port) is not None:
            log.info("metrics on http://%s:%d/metrics", host, self.port)
        service.closers.append(self.close)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class WorkerMetrics(ServiceMetrics):
    """Target or draft worker: sessions held, time in model forwards, sessions per forward, its backend."""

    def __init__(self, role: str = "") -> None:
        super().__init__()
        self.role = role  # target or draft: the `role` label of specd_forward_batch_size
        self.active_sessions = Gauge(
            "specd_active_sessions", "sessions (KV caches) this worker holds", registry=self.registry
        )
        self.kv_cache_bytes = Gauge(
            "specd_kv_cache_bytes", "KV cache bytes this worker's sessions hold or have reserved", registry=self.registry
        )
        self.kv_cache_budget_bytes = Gauge(
            "specd_kv_cache_budget_bytes", "KV cache bytes sessions may hold or reserve (--kv-cache-bytes; 0: no limit)",
            registry=self.registry,
        )
        self.forward_seconds = Histogram(
            "specd_forward_seconds",
            "time of one call's model forwards on this worker",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.forward_batch_size = Histogram(
            "specd_forward_batch_size",
            "sessions whose work one model forward on this worker ran together",
            ["role", "op"],
            buckets=_BATCH_SIZE_BUCKETS,
            registry=self.registry,
        )
        self.backend_info = _BackendInfo(role)
        self.registry.register(self.backend_info)

    def track_sessions(self, store) -> None:
        """Follow a worker's specd.engine.session_cache.SessionStore: its sessions and their KV bytes."""
        self.active_sessions.set_function(lambda: len(store))
        self.kv_cache_bytes.set_function(store.held_bytes)
        self.kv_cache_budget_bytes.set(store.kv_budget.budget_bytes)

    def report_backend(self, runner) -> None:
        """Follow a worker's runner: its `backend` and its `fast_paths`, read at each scrape."""
        self.backend_info.runner = runner

    def observe_forward(self, op: str, forward_ms: float) -> None:
        self.forward_seconds.labels(op=op).observe(forward_ms / 1000.0)

    def observe_batch(self, op: str, sessions: int) -> None:
        """One forward of `op` that ran `sessions` sessions' work together."""
        self.forward_batch_size.labels(role=self.role, op=op).observe(sessions)


class _BackendInfo(Collector):
    """specd_backend_info, read from the worker's runner at each scrape: a fast path can turn off
    while it serves (CUDA graphs whose replay differs from the eager forward)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.runner = None  # once the model is loaded

    def collect(self):
        family = GaugeMetricFamily(
            "specd_backend_info",
            "1 for the device backend this worker runs and the fast paths its model takes (comma-separated)",
            labels=["role", "backend", "fast_paths"],
        )
        if self.runner is not None:
            family.add_metric([self.role, self.runner.backend, ",".join(self.runner.fast_paths)], 1)
        yield family


class CoordinatorMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.num_drafts = Counter("specd_spec_decode_num_drafts", "rounds that proposed >= 1 draft token", registry=r)
        self.num_draft_tokens = Counter("specd_spec_decode_num_draft_tokens", "draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter("specd_spec_decode_num_accepted_tokens", "draft tokens accepted", registry=r)
        self.num_accepted_tokens_per_pos = Counter(
            "specd_spec_decode_num_accepted_tokens_per_pos",
            "rounds whose draft token at position (0-based) was accepted",
            ["position"],
            registry=r,
        )
        self.cache_hits = Counter("specd_speculation_cache_hits", "ssd rounds started from the speculation cache", registry=r)
        self.cache_misses = Counter("specd_speculation_cache_misses", "ssd rounds that missed the speculation cache", registry=r)
        self.time_to_first_token = Histogram(
            "specd_time_to_first_token_seconds", "request start to first generated token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.time_per_output_token = Histogram(
            "specd_time_per_output_token_seconds",
            "(latency - time to first token) / (output tokens - 1)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "specd_e2e_request_latency_seconds", "request start to its last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        # Requests by how they ended, each counted once, over gRPC and HTTP alike: finished (by
        # finish reason) or failed (by the gRPC status code of its error). Tokens are those of
        # finished requests, as their usage says.
        self.request_success = Counter(
            "specd_request_success", "requests finished, by finish reason (stop, length)", ["finished_reason"], registry=r
        )
        self.request_failure = Counter(
            "specd_request_failure",
            "requests that ended without finishing, by gRPC status code (CANCELLED, DEADLINE_EXCEEDED, ...)",
            ["code"],
            registry=r,
        )
        self.prompt_tokens = Counter("specd_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("specd_generation_tokens", "tokens generated by finished requests", registry=r)
        self.requests_in_flight = Gauge("specd_requests_in_flight", "Generate calls being served", registry=r)
        # Admission (coordinator/admission.py), as vLLM names them: a running request holds its
        # place until its worker sessions are ended.
        self.requests_running = Gauge(
            "specd_requests_running", "requests holding a place (--max-concurrent-requests)", registry=r
        )
        self.requests_waiting = Gauge(
            "specd_requests_waiting", "requests queued for a place (--max-queued-requests)", registry=r
        )
        self.requests_waiting_for_session = Gauge(
            "specd_requests_waiting_for_session",
            "admitted requests waiting for a session the target has no room for (--session-wait-s)",
            registry=r,
        )
        self.request_queue_time = Histogram(
            "specd_request_queue_seconds",
            "time an admitted request waited in the queue for a place (0 when one was free)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def track_admission(self, admission) -> None:
        """Follow a coordinator.admission.Admission: its places, its queue, each admitted wait."""
        self.requests_running.set_function(lambda: admission.running)
        self.requests_waiting.set_function(lambda: admission.waiting)
        admission.on_admitted = self.request_queue_time.observe

    def track_session_wait(self, session_wait) -> None:
        """Follow a coordinator.session_wait.SessionWait: the requests waiting for a target session."""
        self.requests_waiting_for_session.set_function(lambda: session_wait.waiting)

    def observe_speculation(self, stats) -> None:
        """Add one request's totals (a coordinator.stats.RequestStats) to the counters."""
        self.num_drafts.inc(stats.speculative_rounds)
        self.num_draft_tokens.inc(stats.draft_tokens)
        self.num_accepted_tokens.inc(stats.accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            if count:
                self.num_accepted_tokens_per_pos.labels(position=str(position)).inc(count)
        self.cache_hits.inc(stats.cache_hits)
        self.cache_misses.inc(stats.cache_misses)

    def observe_success(self, finished_reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        """A request that finished (stop or length), with its usage."""
        self.request_success.labels(finished_reason=finished_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)

    def observe_failure(self, code_name: str) -> None:
        """A request that ended without finishing: `code_name` is the grpc.StatusCode name it
        ended with (INVALID_ARGUMENT, CANCELLED, DEADLINE_EXCEEDED, ...). Once per request,
        never for one that was counted as finished."""
        self.request_failure.labels(code=code_name).inc()

    def observe_latency(self, ttft_s: float | None, latency_s: float, output_tokens: int) -> None:
        self.request_latency.observe(latency_s)
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
            if output_tokens > 1:
                self.time_per_output_token.observe((latency_s - ttft_s) / (output_tokens - 1))
