"""The model thread: one per model, so forwards never run on the event loop, and never two at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Callable

from specd.core.errors import no_stop_iteration


class ModelThread:
    """One thread per model: forwards never run on the event loop, and never two at once."""

    def __init__(self, name: str):
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, no_stop_iteration, fn, *args)

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Queue `fn(*args)` behind the work already queued, from any thread (the model
        thread included: work it queues for itself runs without a turn of the event loop)."""
        return self._executor.submit(no_stop_iteration, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
