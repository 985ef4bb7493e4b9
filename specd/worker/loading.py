"""A worker's model, loaded once on the backend its device picks, with that backend's fast paths."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from specd.engine.backends import FastPathOptions, backend_for
from specd.engine.forward import warm_up
from specd.engine.loading import LoadedModel, load_causal_lm
from specd.worker.config import WorkerConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PreparedModel:
    loaded: LoadedModel
    backend: str  # cpu or cuda: the backend the worker runs
    fast_paths: tuple[str, ...]  # the backend's fast paths the model took
    lean_forward: bool  # a draft runs its forwards through specd's lean Llama loop


def load_prepared(
    role: str, config: WorkerConfig, halved: bool = False, adjust: Callable[[LoadedModel], None] | None = None
) -> PreparedModel:
    """Pick the backend once, load the model on its device, let `adjust` change the model before
    the fast paths are set up (a draft drops padded embedding rows), set them up, warm up."""
    backend = backend_for(config.device)
    backend.set_threads(config.threads)
    loaded = load_causal_lm(config.model, dtype=backend.dtype(config.dtype), device=backend.device)
    if adjust is not None:
        adjust(loaded)
    options = FastPathOptions(config.prepack_weights, config.few_row_kernel, halved, config.grouped_attention)
    fast_paths = tuple(backend.prepare(loaded.model, options))
    warm_up(loaded.model)
    log.info("%s worker on the %s backend (%s); fast paths: %s", role, backend.name, backend.device, ", ".join(fast_paths) or "none")
    return PreparedModel(loaded, backend.name, fast_paths, backend.lean_forward)
