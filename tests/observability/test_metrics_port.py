"""The metrics port serves /metrics, as prometheus_client writes it, and 404 on every other path."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import generate_latest

from specd.observability.metrics import CoordinatorMetrics, WorkerMetrics


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.parametrize("metrics_class", [CoordinatorMetrics, WorkerMetrics])
def test_metrics_on_metrics_and_404_elsewhere(metrics_class):
    metrics = metrics_class()
    port = metrics.serve("127.0.0.1", 0)
    try:
        status, body = _get(port, "/metrics")
        assert status == 200
        assert body == generate_latest(metrics.registry)
        for path in ("/", "/health", "/v1/models", "/metrics/", "/favicon.ico"):
            status, body = _get(port, path)
            assert status == 404, path
            assert b"/metrics" in body and b"specd_" not in body
    finally:
        metrics.close()


def test_no_port_when_turned_off():
    metrics = CoordinatorMetrics()
    assert metrics.serve("127.0.0.1", -1) is None and metrics.port is None

