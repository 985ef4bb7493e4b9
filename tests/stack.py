"""The three services, started in-process on port 0 on an event loop in a background thread.

Tests talk to them through real gRPC channels, as any client would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from typing import Callable

import grpc

from coordinator.config import PROFILE_SETTINGS, CoordinatorConfig
from coordinator.server import start_coordinator
from draft_service.config import DraftConfig
from draft_service.server import start_draft
from specd.v1 import coordinator_pb2_grpc
from target_service.calls import PrefillCall, VerifyCall
from target_service.config import TargetConfig
from target_service.server import start_target


class ServiceStack:
    def __init__(
        self,
        target_model: str,
        draft_model: str | None,
        coordinator_overrides: dict | None = None,
        draft_overrides: dict | None = None,
        target_overrides: dict | None = None,
        tracer_providers: dict | None = None,
    ):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.target_model = target_model
        self.draft_model = draft_model
        self.coordinator_overrides = coordinator_overrides or {}
        self.draft_overrides = draft_overrides or {}
        self.target_overrides = target_overrides or {}
        self.tracer_providers = tracer_providers or {}  # role -> TracerProvider (default: from env)
        self.target = self.draft = self.coordinator = None
        self.more_coordinators: list = []  # another_coordinator()'s

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> "ServiceStack":
        self.target = self.run(self._start_target())
        if self.draft_model is not None:
            self.draft = self.run(self._start_draft())
        self.coordinator = self.run(self._start_coordinator())
        return self

    async def _start_target(self, port: int = 0):
        config = TargetConfig(model=self.target_model, host="127.0.0.1", port=port, metrics_port=-1, device="cpu")
        service = await start_target(
            dataclasses.replace(config, **self.target_overrides), tracer_provider=self.tracer_providers.get("target")
        )
        await service.ready
        return service

    async def _start_draft(self, port: int = 0):
        config = DraftConfig(model=self.draft_model, host="127.0.0.1", port=port, metrics_port=-1, device="cpu")
        service = await start_draft(
            dataclasses.replace(config, **self.draft_overrides), tracer_provider=self.tracer_providers.get("draft")
        )
        await service.ready
        return service

    async def _start_coordinator(self):
        config = CoordinatorConfig(
            host="127.0.0.1",
            port=0,
            metrics_port=-1,
            http_port=-1,  # a test that calls the HTTP API asks for one (http_port=0)
            target_address=f"127.0.0.1:{self.target.port}",
            draft_address=f"127.0.0.1:{self.draft.port}" if self.draft is not None else "",
            draft_retry_s=0.2,
            worker_timeout_s=30.0,
        )
        service = await start_coordinator(
            dataclasses.replace(config, **self.coordinator_overrides),
            tracer_provider=self.tracer_providers.get("coordinator"),
        )
        await service.ready
        return service

    def another_coordinator(self):
        """One more coordinator, with the same settings, on the same workers; close() stops it."""
        service = self.run(self._start_coordinator())
        self.more_coordinators.append(service)
        return service

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.coordinator.port}"

    @property
    def http_url(self) -> str:
        """The coordinator's HTTP API (started with coordinator_overrides={"http_port": 0})."""
        return f"http://127.0.0.1:{self.coordinator.http.port}"

    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        channel = grpc.insecure_channel(self.address)
        return coordinator_pb2_grpc.CoordinatorStub(channel)

    def stop_draft(self) -> None:
        self.run(self.draft.stop(0))

    def restart_draft(self) -> None:
        """A fresh draft worker on the same port: every session it held is gone."""
        self.draft = self.run(self._start_draft(port=self.draft.port))

    def stop_target(self) -> None:
        self.run(self.target.stop(0))

    def restart_target(self) -> None:
        """A fresh target worker on the same port: every session it held is gone. Returns once the
        coordinator's channel to it is connected again: a channel that failed to connect while the
        target was down waits out a reconnect backoff, and a call in it fails UNAVAILABLE."""
        self.target = self.run(self._start_target(port=self.target.port))
        self.run(asyncio.wait_for(self.coordinator.servicer.target.connected(), CHANNEL_READY_S))

    def close(self) -> None:
        for service in (*self.more_coordinators, self.coordinator, self.draft, self.target):
            if service is not None:
                try:
                    self.run(service.stop(0), timeout=10)
                except Exception:  # noqa: BLE001 - already stopped
                    pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


def wait_for(condition, timeout_s: float, every_s: float = 0.02) -> bool:
    """Polls `condition` until it holds or `timeout_s` passes; whether it held at the end."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every_s)
    return condition()


GATE_TIMEOUT_S = 60.0  # a held call goes on by itself after this: a failing test never hangs
CHANNEL_READY_S = 30.0  # a restarted target the coordinator cannot reach fails the test instead


class RunnerGate:
    """Holds a worker runner's next `name` call on its model thread until released: a fixed point
    mid-request. `holds(*args, **kwargs)` picks which calls are held (every one by default)."""

    def __init__(self, runner, name: str, holds: Callable[..., bool] | None = None):
        self._runner = runner
        self._name = name
        self._original = getattr(runner, name)
        self._holds = holds
        self.held = threading.Event()
        self._release = threading.Event()
        setattr(runner, name, self._call)  # the servicer looks the method up on every call

    def _call(self, *args, **kwargs):
        if not self._release.is_set() and (self._holds is None or self._holds(*args, **kwargs)):
            self.held.set()
            self._release.wait(GATE_TIMEOUT_S)
        return self._original(*args, **kwargs)

    def release(self) -> None:
        self._release.set()
        setattr(self._runner, self._name, self._original)


def target_gate(runner, call_type: type) -> RunnerGate:
    """Holds the target's model thread at its next batch with a `call_type` call in it.

    The target's servicer runs every call through run_batch, and calls that arrive together
    share one batch without going through prefill() or verify(): a gate on those would let
    concurrent requests pass whenever they happened to be batched."""
    return RunnerGate(runner, "run_batch", holds=lambda calls, *_: any(isinstance(call, call_type) for call in calls))


def prefill_gate(runner) -> RunnerGate:
    return target_gate(runner, PrefillCall)


def verify_gate(runner) -> RunnerGate:
    return target_gate(runner, VerifyCall)


def count_target_calls(runner, call_type: type) -> list[int]:
    """How many `call_type` calls (VerifyCall, PrefillCall) the target's runner is given from now
    on: the servicer runs every call through run_batch (a call cut into chunks counts each time)."""
    count = [0]
    original = runner.run_batch

    def counted(calls, *args, **kwargs):
        count[0] += sum(isinstance(call, call_type) for call in calls)
        return original(calls, *args, **kwargs)

    runner.run_batch = counted
    return count


def count_calls(runner, name: str) -> list[int]:
    count = [0]
    original = getattr(runner, name)

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    setattr(runner, name, counted)
    return count


def slow_verify(runner, seconds: float) -> None:
    """A target that verifies slower than the tiny draft builds its cache, as a large one does."""
    original = runner.run_batch

    def slow(calls, most_tokens=None):  # as slow per session verified as before batching: a large target's share
        time.sleep(seconds * len(calls))
        return original(calls, most_tokens)

    runner.run_batch = slow


@contextlib.contextmanager
def coordinator_settings(servicer, **overrides):
    """The coordinator's settings changed for what runs inside: its config's, and the device
    profile's that the config overrides (ssd_budget, ssd_backup, ...)."""
    config, profile = servicer.config, servicer.profile
    changed = dataclasses.replace(config, **overrides)
    profile_changes = {name: value for name, value in overrides.items() if name in PROFILE_SETTINGS}
    servicer.config = servicer.generator.config = changed
    servicer.profile = dataclasses.replace(profile, **profile_changes)
    try:
        yield
    finally:
        servicer.config = servicer.generator.config = config
        servicer.profile = profile
