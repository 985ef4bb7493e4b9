"""Multi-step model jobs of different sessions advance together, one forward per step.

A draft worker's calls are loops of forwards: a Propose drafts K tokens one step at a time, a
Speculate runs step 0 and then grows its tree a step at a time. Written as generators that
yield each forward they need (a `Step`) and receive its logits (with what they read of them, read
back for all jobs of a forward at once), the jobs of every session in
flight can share forwards: each turn of the model thread takes the next step of every active
job (new jobs join at the next turn, at most one per session) and runs them as one packed
forward, or alone when a single job is active, through the job's own forward, as before
batching. Between turns the model thread serves whatever else is queued on it.

A job's generator returns its result (StopIteration.value); an exception it raises fails that
job alone. A forward that fails fails every job in it. When no job is active, a turn may wait a
little for the sessions of the last forwards to send their next calls (specd/engine/turns.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable, Generator, Hashable, NamedTuple

import torch

from specd.core.errors import TooManySessions
from specd.engine.host_copy import to_host
from specd.engine.kv_pool import make_room
from specd.engine.packed_forward import Packer, Segment
from specd.engine.turns import Pending, Turns

Logits = tuple[torch.Tensor, float]  # ([num_logits, V] float32, forward ms)
Reads = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # logits [num_logits, V] -> tensors on their device


def _reads_nothing(logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return ()


@dataclasses.dataclass(frozen=True)
class Step:
    """One forward a job needs: as a packed segment, and as the job would run it alone; and what
    the job reads of its logits, which a turn brings to the host with every other job's (on a GPU
    each read-back waits for the device: one wait a forward, not one a job)."""

    segment: Segment
    alone: Callable[[], Logits]
    read: Reads = _reads_nothing


class StepOutput(NamedTuple):
    """What a job's step gives it back."""

    logits: torch.Tensor  # [num_logits, V] float32, on the model's device
    forward_ms: float
    read: list[torch.Tensor]  # the step's `read` of the logits, on the host


Job = Generator[Step, StepOutput, object]


@dataclasses.dataclass
class _Active:
    make_job: Callable[[], Job]  # called on the model thread when the job is admitted
    session: Hashable
    future: concurrent.futures.Future
    job: Job | None = None
    step: Step | None = None


def run_alone(job: Job):
    """Drive a job by itself on the calling thread; its result."""
    try:
        step = next(job)
        while True:
            result = step.alone()
            try:
                (output,) = read_back([step], [result])
            except Exception as exc:  # noqa: BLE001 - the read-back failed: the job's own clean-up runs, and it fails
                output = exc
            step = job.throw(output) if isinstance(output, Exception) else job.send(output)
    except StopIteration as stop:
        return stop.value


def read_back(steps: list[Step], results: list[Logits]) -> list[StepOutput | Exception]:
    """Each step's output, every step's `read` brought to the host in one wait; a step whose read
    fails gets its error instead."""
    wanted: list[tuple[torch.Tensor, ...] | Exception] = []
    for step, (logits, _) in zip(steps, results):
        try:
            wanted.append(tuple(step.read(logits)))
        except Exception as exc:  # noqa: BLE001 - that job alone fails
            wanted.append(exc)
    host = iter(to_host(*[t for w in wanted if not isinstance(w, Exception) for t in w]))
    return [
        w if isinstance(w, Exception) else StepOutput(logits, forward_ms, [next(host) for _ in w])
        for w, (logits, forward_ms) in zip(wanted, results)
    ]


def guarded_step(session, step: Step):
    """Yield `step` from a job; a forward that failed part-way leaves `session` caching nothing
    (no layer's entries can be trusted), and the job fails."""
    try:
        return (yield step)
    except GeneratorExit:  # the job was closed: nothing ran
        raise
    except BaseException:
        session.reset()
        raise


def forward_steps(steps: list[Step], packer: Packer | None) -> list[Logits]:
    """Each step's logits: one packed forward for several, a lone forward for one (except over the
    KV pool, whose forwards of any count replay as CUDA graphs on a GPU)."""
    if packer is None or (len(steps) == 1 and not packer.pooled):
        return [step.alone() for step in steps]
    logits, forward_ms = packer.forward([step.segment for step in steps])
    return [(row, forward_ms) for row in logits]


class StepBatcher:
    """`submit(fn)` queues work on the model thread; `observe(batch_size, forward_ms)` sees each forward."""

    def __init__(
        self,
        submit: Callable,
        packer: Packer | None,
        max_batch: int,
        observe: Callable[[int, float], None] | None = None,
        max_wait_s: float = 0.0,
    ):
        self._packer = packer
        self._max_batch = max_batch
        self._observe = observe
        self._lock = threading.Lock()
        self._pending: collections.deque[_Active] = collections.deque()
        self._active: list[_Active] = []  # the model thread's alone
        self._turns = Turns(submit, self._turn, self._pending_sessions, self._refuse, max_batch, max_wait_s)

    def start(self, make_job: Callable[[], Job], session: Hashable) -> concurrent.futures.Future:
        """Run the job `make_job()` makes (on the model thread) in the next turns; the future
        resolves to its result."""
        entry = _Active(make_job, session, concurrent.futures.Future())
        with self._lock:
            self._pending.append(entry)
        self._turns.poke()
        return entry.future

    def _pending_sessions(self) -> Pending:
        with self._lock:
            return {entry.session for entry in self._pending}, bool(self._active)

    def _refuse(self, exc: BaseException) -> None:
        with self._lock:
            failed, self._pending = list(self._pending), collections.deque()
        for entry in failed:
            if entry.future.set_running_or_notify_cancel():
                entry.future.set_exception(exc)

    def _turn(self) -> None:
        """On the model thread: admit new jobs, run one step of every active job."""
        served, forward_s = [], None
        try:
            self._admit()
            served, forward_s = self._advance(self._active)
            self._active = [entry for entry in self._active if not entry.future.done()]
        finally:  # the next turn is never lost
            self._turns.done(served, forward_s)

    def forget(self, session: Hashable) -> None:
        """The session ended (EndSession): its jobs not yet started are cancelled, since starting
        them would only open the session again, to be held until the idle timeout (a job under
        way holds the session object, not the store's entry); and the next turns do not wait for it."""
        with self._lock:
            dropped = [entry for entry in self._pending if entry.session == session]
            self._pending = collections.deque(entry for entry in self._pending if entry.session != session)
        for entry in dropped:
            entry.future.cancel()
        self._turns.forget(session)

    def _admit(self) -> None:
        """Pending jobs whose session has no active job, oldest first, up to the cap: each
        takes its first step (a job that fails there, or was cancelled, leaves at once)."""
        busy = {entry.session for entry in self._active}
        admitted = []
        with self._lock:
            waiting, self._pending = self._pending, collections.deque()
            for entry in waiting:
                if len(self._active) + len(admitted) >= self._max_batch or entry.session in busy:
                    self._pending.append(entry)
                elif entry.future.set_running_or_notify_cancel():
                    admitted.append(entry)
                    busy.add(entry.session)
        for entry in admitted:
            try:
                entry.job = entry.make_job()
            except BaseException as exc:  # noqa: BLE001 - this job alone fails
                entry.future.set_exception(exc)
                continue
            self._active.append(entry)
            self._resume(entry, None)

    def _advance(self, active: list[_Active]) -> tuple[list[Hashable], float | None]:
        """One forward of every job's next step; the sessions it served and its seconds."""
        ready = [entry for entry in active if entry.step is not None and self._has_room(entry)]
        if not ready:
            return [], None
        started = time.perf_counter()
        try:
            results = forward_steps([entry.step for entry in ready], self._packer)
        except BaseException as exc:  # noqa: BLE001 - every job of the forward reports it
            for entry in ready:
                self._fail(entry, exc)
            return [], None
        forward_s = time.perf_counter() - started
        if self._observe is not None:
            self._observe(len(ready), results[0][1])
        try:
            outputs = read_back([entry.step for entry in ready], results)
        except BaseException as exc:  # noqa: BLE001 - the read-back they share failed: every job of the forward reports it
            for entry in ready:
                self._fail(entry, exc)  # not left holding a step that already ran
            return [], None
        for entry, output in zip(ready, outputs):
            if isinstance(output, Exception):
                self._fail(entry, output)
            else:
                self._resume(entry, output)
        return [entry.session for entry in ready], forward_s

    def _has_room(self, entry: _Active) -> bool:
        """Whether the job's cache has room for its step (a pooled cache moves first if need be);
        a job whose cache cannot get it fails alone, not every job of the forward."""
        segment = entry.step.segment
        try:
            make_room(segment.cache, len(segment.tokens))
        except TooManySessions as exc:
            self._fail(entry, exc)
            return False
        return True

    def _resume(self, entry: _Active, output: StepOutput | None) -> None:
        """Give a job its step's output (None: start it); keep its next step or settle it."""
        try:
            entry.step = next(entry.job) if output is None else entry.job.send(output)
        except StopIteration as stop:
            entry.step = None
            entry.future.set_result(stop.value)
        except BaseException as exc:  # noqa: BLE001 - this job alone fails
            entry.step = None
            entry.future.set_exception(exc)

    @staticmethod
    def _fail(entry: _Active, exc: BaseException) -> None:
        try:
            entry.job.throw(exc)  # its own clean-up runs (a tree crops itself)
        except BaseException:  # noqa: BLE001 - it re-raises: the forward's error is the answer
            pass
        entry.step = None
        if not entry.future.done():
            entry.future.set_exception(exc)
