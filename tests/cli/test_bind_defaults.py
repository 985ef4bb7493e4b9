"""`specd serve` binds loopback unless told otherwise: gRPC, HTTP and /metrics alike."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from unittest import mock

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.server import start_coordinator
from specd.cli import build_parser
from specd.cli.serve import ROLES


@pytest.mark.parametrize("role", list(ROLES))
def test_serve_binds_loopback_by_default_and_host_or_env_changes_it(role):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    argv = ["serve", role, "--model", "m"] if role != "coordinator" else ["serve", role]
    with mock.patch.dict(os.environ, clean, clear=True):
        assert build_parser(argv).parse_args(argv).host == "127.0.0.1"
        assert build_parser(argv).parse_args([*argv, "--host", "0.0.0.0"]).host == "0.0.0.0"
    with mock.patch.dict(os.environ, {**clean, "SPECD_HOST": "0.0.0.0"}, clear=True):
        assert build_parser(argv).parse_args(argv).host == "0.0.0.0"


def test_the_metrics_and_http_servers_bind_the_same_loopback_host():
    async def bound_hosts() -> tuple[str, str]:
        # No target listens there: the coordinator serves (NOT_SERVING) and waits for it.
        config = dataclasses.replace(CoordinatorConfig(), port=0, metrics_port=0, http_port=0, target_address="127.0.0.1:1")
        service = await start_coordinator(config)
        try:
            return service.metrics._server.server_address[0], service.http.runner.addresses[0][0]
        finally:
            await service.stop(0)

    assert asyncio.run(bound_hosts()) == ("127.0.0.1", "127.0.0.1")
