"""Normal cancellations leave the logs clean: no ERROR record, no "Failed to detach context".

Callers that go away mid-request (a cancelled stream, a deadline, a cancelled unary call) are
everyday traffic: the coordinator cancels its speculation calls, the draft stops its tree,
asyncio closes generators left at a yield. None of that may log at ERROR, with tracing
recording spans or not; a real error still does (the last test).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import threading
import time

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specd.v1 import common_pb2
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, running_stack

MODES = (pb.SPECULATION_MODE_SSD, pb.SPECULATION_MODE_SSD, pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_OFF)
PROMPTS = ("def add(a, b):", "for i in range(10):", "The quick brown fox")
CLIENTS, REQUESTS_EACH = 4, 24


def _recording_providers() -> dict:
    providers = {}
    for role in ("coordinator", "target", "draft"):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        providers[role] = provider
    return providers


def _request(rng: random.Random, index: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=rng.choice(PROMPTS),
        max_new_tokens=rng.choice((16, 48, 96)),
        ignore_eos=True,
        speculation=pb.SpeculationParams(mode=rng.choice(MODES)),
        sampling=common_pb2.SamplingParams(temperature=rng.choice((0.0, 1.0)), seed=index),
    )


def _one_call(stub, rng: random.Random, index: int) -> str:
    """One request that ends in a cancellation (mostly) or completes; returns its outcome."""
    request = _request(rng, index)
    kind = ("cancel_stream", "deadline", "cancel_unary", "complete")[index % 4]
    try:
        if kind == "cancel_stream":
            call = stub.GenerateStream(request, timeout=CALL_TIMEOUT_S)
            stop_after = rng.randint(0, 4)
            for received, _ in enumerate(call, 1):
                if received >= stop_after:
                    break
            call.cancel()
        elif kind == "deadline":
            for _ in stub.GenerateStream(request, timeout=rng.uniform(0.01, 0.3)):
                pass
        elif kind == "cancel_unary":
            future = stub.Generate.future(request, timeout=CALL_TIMEOUT_S)
            threading.Event().wait(rng.uniform(0.0, 0.1))
            future.cancel()
        else:
            stub.Generate(request, timeout=CALL_TIMEOUT_S)
        return f"{kind}:OK"
    except grpc.RpcError as exc:
        return f"{kind}:{exc.code().name}"


def _run_clients(stack) -> list[str]:
    outcomes: list[str] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        stub = stack.stub()
        for i in range(REQUESTS_EACH):
            outcomes.append(_one_call(stub, rng, seed * REQUESTS_EACH + i))

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return outcomes


def _wait_sessions_freed(stack, deadline_s: float = 30.0) -> None:
    """Every request's sessions gone from both workers: what a cancellation cleans up has run
    (and so would have logged), within the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        held = {name: len(service.servicer.runner.sessions) for name, service in
                (("target", stack.target), ("draft", stack.draft))}
        if not any(held.values()):
            return
        assert time.monotonic() < deadline, f"sessions still held: {held}"
        time.sleep(0.1)


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
def test_cancellations_log_no_error(tiny_pair, caplog, traced):
    target, draft = tiny_pair
    providers = _recording_providers() if traced else None
    caplog.set_level(logging.DEBUG, logger="opentelemetry")
    caplog.set_level(logging.INFO)
    with running_stack(target, draft, tracer_providers=providers) as stack:
        outcomes = _run_clients(stack)
        _wait_sessions_freed(stack)
        gc.collect()  # generators left at a yield are closed now, on the stack's loop
        stack.run(_settle())
    assert len(outcomes) == CLIENTS * REQUESTS_EACH
    allowed = {"OK", "CANCELLED", "DEADLINE_EXCEEDED"}
    assert {o.split(":")[1] for o in outcomes} <= allowed, sorted(set(outcomes))
    assert any(o.startswith("cancel_stream") for o in outcomes)
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    detach = [r.getMessage() for r in caplog.records if "Failed to detach context" in r.getMessage()]
    assert not errors, errors[:5]
    assert not detach, detach[:5]


async def _settle() -> None:
    for _ in range(20):  # a few turns of the loop: the closing tasks asyncio made run to the end
        await asyncio.sleep(0.05)


def test_a_real_error_still_logs(tiny_pair, caplog):
    """Quiet cancellations must not mean quiet failures: an unexpected exception in a worker
    call still logs at ERROR and reaches the caller as INTERNAL."""
    target, draft = tiny_pair
    caplog.set_level(logging.INFO)
    with running_stack(target, draft) as stack:
        runner = stack.target.servicer.runner

        def broken(*args, **kwargs):
            raise RuntimeError("the target's forward broke")

        original, runner.run_batch = runner.run_batch, broken  # the servicer runs every call through it
        try:
            with pytest.raises(grpc.RpcError) as failed:
                stack.stub().Generate(pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=4), timeout=CALL_TIMEOUT_S)
        finally:
            runner.run_batch = original
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert any(r.levelno >= logging.ERROR and "forward broke" in str(r.exc_info and r.exc_info[1]) for r in caplog.records)
