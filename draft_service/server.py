"""Start the draft worker: gRPC server first (health NOT_SERVING), then load and warm the model."""

from __future__ import annotations

import logging

from draft_service.config import DraftConfig
from draft_service.runner import DraftModelRunner
from draft_service.servicer import DraftServicer
from specd.engine.loading import LoadedModel
from specd.serving.server import RunningService
from specd.v1 import draft_pb2, draft_pb2_grpc
from specd.worker.loading import load_prepared
from specd.worker.server import start_worker
from specd.worker.sessions import session_store

log = logging.getLogger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name


def load_runner(config: DraftConfig) -> DraftModelRunner:
    prepared = load_prepared("draft", config, halved=config.few_row_bf16, adjust=_drop_padded_rows)
    sessions, loaded = session_store(config, prepared.loaded)
    return DraftModelRunner(
        loaded, sessions, config.max_support, config.copy_drafting(), backend=prepared.backend,
        fast_paths=prepared.fast_paths, lean=prepared.lean_forward, cuda_graphs=config.cuda_graphs,
    )


def _drop_padded_rows(loaded: LoadedModel) -> None:
    """Checkpoints pad their embeddings past the tokenizer: rows no text maps to. The draft's q must
    not propose them (the target refuses ids outside its tokenizer), so they go, before the fast
    paths are set up (a tied output layer is packed as it will serve)."""
    if loaded.model.get_input_embeddings().weight.shape[0] > loaded.vocab_size:
        loaded.model.resize_token_embeddings(loaded.vocab_size)


async def start_draft(config: DraftConfig, interceptors: list | None = None, tracer_provider=None) -> RunningService:
    return await start_worker(
        "draft",
        config,
        lambda thread: DraftServicer(
            thread, config.max_speculate_branches, config.max_speculate_depth, config.max_batch_size, config.batch_wait_ms,
            config.retired_session_memory_s,
        ),
        draft_pb2_grpc.add_DraftWorkerServicer_to_server,
        SERVICE_NAME,
        lambda: load_runner(config),
        interceptors,
        tracer_provider,
    )


async def serve(config: DraftConfig) -> None:
    service = await start_draft(config)
    log.info("draft worker started on %s:%d, loading %s", config.host, service.port, config.model)
    await service.serve_until_signal()
