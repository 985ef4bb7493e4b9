"""The target worker in one process: load the model and start its gRPC server."""

from __future__ import annotations

from typing import Callable

from specd.core.config import ConfigError
from specd.engine.tokenizer_export import export_tokenizer_or_none
from specd.serving.server import RunningService
from specd.v1 import target_pb2, target_pb2_grpc
from specd.worker.loading import load_prepared
from specd.worker.server import start_worker
from specd.worker.sessions import session_store
from target_service.config import TargetConfig
from target_service.prefill_pacing import FIRST_CHUNK_TOKENS, PrefillPacer
from target_service.runner import TargetModelRunner
from target_service.servicer import TargetServicer

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name


def load_runner(config: TargetConfig) -> TargetModelRunner:
    """The whole model on one device."""
    if config.tensor_parallel > 1:
        raise ConfigError("a tensor-parallel target starts through target_service.tensor_parallel.serve")
    prepared = load_prepared("target", config)
    sessions, loaded = session_store(config, prepared.loaded)
    return TargetModelRunner(
        loaded, sessions, prefill_chunk=config.prefill_chunk_tokens, backend=prepared.backend,
        fast_paths=prepared.fast_paths, tokenizer_spec=export_tokenizer_or_none(prepared.loaded.tokenizer),
        cuda_graphs=config.cuda_graphs,
    )


async def start_target(
    config: TargetConfig,
    interceptors: list | None = None,
    tracer_provider=None,
    load: Callable[[], object] | None = None,
) -> RunningService:
    """Serve at once; `load` (default: the whole model here) runs on the model thread."""
    return await start_worker(
        "target",
        config,
        lambda thread: TargetServicer(
            thread, config.verify_after_wait_s, tensor_parallel=config.tensor_parallel, max_batch_size=config.max_batch_size,
            batch_wait_ms=config.batch_wait_ms, retired_session_memory_s=config.retired_session_memory_s,
            prefill_pacer=PrefillPacer(config.prefill_chunk_ms, config.prefill_chunk_tokens or FIRST_CHUNK_TOKENS),
        ),
        target_pb2_grpc.add_TargetWorkerServicer_to_server,
        SERVICE_NAME,
        load or (lambda: load_runner(config)),
        interceptors,
        tracer_provider,
    )
