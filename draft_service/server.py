"""Start the draft worker: gRPC server first (health NOT_SERVING), then load and warm the model."""

from __future__ import annotations

import logging

from draft_service.config import DraftConfig
from draft_service.runner import DraftModelRunner
from draft_service.servicer import DraftServicer
from specd.engine.forward import prepare_forwards, warm_up
from specd.engine.loading import load_causal_lm, set_threads
from specd.engine.session_cache import SessionStore
from specd.serving.server import RunningService
from specd.v1 import draft_pb2, draft_pb2_grpc
from specd.worker.server import start_worker

log = logging.getLogger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name


def load_runner(config: DraftConfig) -> DraftModelRunner:
    set_threads(config.threads)
    loaded = load_causal_lm(config.model, dtype=config.dtype, device=config.device)
    if loaded.model.get_input_embeddings().weight.shape[0] > loaded.vocab_size:
        # Checkpoints pad their embeddings past the tokenizer: rows no text maps to. The draft's q
        # must not propose them (the target refuses ids outside its tokenizer), so drop them.
        loaded.model.resize_token_embeddings(loaded.vocab_size)
    # After the resize: a tied output layer is packed as it will serve.
    prepare_forwards(
        loaded.model, config.prepack_weights, config.few_row_kernel, config.few_row_bf16, config.grouped_attention
    )
    warm_up(loaded.model)
    sessions = SessionStore(config.max_sessions, config.session_idle_timeout_s)
    return DraftModelRunner(loaded, sessions, config.max_support, config.copy_drafting())


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
