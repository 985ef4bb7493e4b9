"""Load: 16 streaming clients for 60 s on loopback, every mode, greedy and sampled.

Bounded in clients, time and tokens; it asserts outcomes, not speed: zero errors, every stream
complete, greedy streams the target's own output, no ERROR logged, and every session freed on
both workers within a deadline afterwards.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from specd.v1 import coordinator_pb2 as pb
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    greedy_reference,
    load_reference,
    request,
    running_stack,
)

CLIENTS = 16
DURATION_S = 60.0
SESSIONS_FREED_WITHIN_S = 15.0
PROMPTS = ("def add(a, b):", "for i in range(10):", "class Point:")
MODES = (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD)
MAX_NEW_TOKENS = (16, 32)


def _stream(stub, message: pb.GenerateRequest) -> tuple[list[int], pb.GenerateStreamResponse]:
    """One whole stream: its tokens and its last message (which carries the finish)."""
    tokens, last = [], None
    for last in stub.GenerateStream(message, timeout=CALL_TIMEOUT_S):
        tokens.extend(last.token_ids)
    return tokens, last


class Load:
    """CLIENTS threads streaming until the deadline; what went wrong, and the greedy outputs."""

    def __init__(self, stack, prompt_ids: dict[str, list[int]]):
        self.stack, self.prompt_ids = stack, prompt_ids
        self.errors: list[str] = []
        self.greedy: list[tuple[str, list[int]]] = []  # (prompt, tokens), checked afterwards
        self.completed = 0
        self._lock = threading.Lock()

    def client(self, index: int, stop_at: float) -> None:
        stub = self.stack.stub()
        turn = 0
        while time.monotonic() < stop_at:
            prompt = PROMPTS[(index + turn) % len(PROMPTS)]
            greedy = (index + turn) % 2 == 0
            max_new = MAX_NEW_TOKENS[turn % len(MAX_NEW_TOKENS)]
            message = request(self.prompt_ids[prompt], mode=MODES[(index + turn) % len(MODES)], max_new_tokens=max_new,
                              temperature=0.0 if greedy else 0.8, seed=None if greedy else index * 1000 + turn)
            turn += 1
            try:
                tokens, last = _stream(stub, message)
            except grpc.RpcError as exc:
                self._record_error(f"client {index}: {exc.code().name}: {exc.details()}")
                continue
            if last is None or last.finish_reason != pb.FINISH_REASON_LENGTH or len(tokens) != max_new:
                self._record_error(f"client {index}: incomplete stream, {len(tokens)} of {max_new} tokens")
                continue
            with self._lock:
                self.completed += 1
                if greedy:
                    self.greedy.append((prompt, tokens))

    def _record_error(self, error: str) -> None:
        with self._lock:
            self.errors.append(error)

    def run(self) -> None:
        stop_at = time.monotonic() + DURATION_S
        threads = [threading.Thread(target=self.client, args=(i, stop_at)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=DURATION_S + 2 * CALL_TIMEOUT_S)
        assert not any(thread.is_alive() for thread in threads), "a client hangs"


def _sessions_held(stack) -> dict[str, int]:
    return {name: len(service.servicer.runner.sessions) for name, service in (("target", stack.target), ("draft", stack.draft))}


def test_sixteen_streams_for_a_minute(tiny_pair, caplog):
    caplog.set_level(logging.WARNING)
    model, tokenizer = load_reference(tiny_pair[0])
    prompt_ids = {prompt: tokenizer.encode(prompt) for prompt in PROMPTS}
    references = {prompt: greedy_reference(model, ids, max(MAX_NEW_TOKENS)) for prompt, ids in prompt_ids.items()}
    with running_stack(*tiny_pair) as stack:
        load = Load(stack, prompt_ids)
        load.run()
        deadline = time.monotonic() + SESSIONS_FREED_WITHIN_S
        while any((held := _sessions_held(stack)).values()):
            assert time.monotonic() < deadline, f"sessions still held {SESSIONS_FREED_WITHIN_S} s after the load: {held}"
            time.sleep(0.1)
    assert not load.errors, f"{len(load.errors)} errors, e.g. {load.errors[:5]}"
    assert load.completed >= CLIENTS, f"only {load.completed} streams completed"
    for prompt, tokens in load.greedy:
        assert_greedy_equal_or_near_tie(model, prompt_ids[prompt], tokens, references[prompt][: len(tokens)])
    logged = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    assert not logged, logged[:5]
