"""Start the coordinator: wait for the target worker, load its tokenizer, check the draft's."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from coordinator.auth import BearerTokenInterceptor, read_token
from coordinator.config import CoordinatorConfig
from coordinator.draft_link import DraftLink
from coordinator.http.server import start_http
from coordinator.profiles import profile_for
from coordinator.request import TargetFacts
from coordinator.servicer import CoordinatorServicer
from coordinator.target_link import TargetLink
from coordinator.tokenizer import Tokenizer
from specd.core.config import ConfigError
from specd.core.sampling import SamplingSettings
from specd.observability.metrics import CoordinatorMetrics
from specd.observability.telemetry import SERVICE_NAMES, get_tracer, tracer_provider_from_env
from specd.observability.telemetry import client_interceptors as traced_client_interceptors
from specd.serving.server import NOT_SERVING, SERVING, RunningService, create_server
from specd.serving.tls import channel_credentials, server_credentials
from specd.v1 import coordinator_pb2, coordinator_pb2_grpc
from specd.wire.convert import sampling_from_proto, tokenizer_probes_from_proto, tokenizer_spec_from_proto

log = logging.getLogger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


class TokenizerMismatch(ConfigError):
    """Draft and target tokenizers map strings to different ids: speculation would be wrong."""


async def wait_for_target(target: TargetLink, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await target.info(timeout_s=5.0)
        except grpc.aio.AioRpcError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the target worker at {target.address} did not serve within {timeout_s:.0f} s "
                    f"({exc.code().name}: {exc.details()})"
                ) from None
            await asyncio.sleep(0.5)


def coordinator_tokenizer(config: CoordinatorConfig, info) -> Tokenizer:
    """The target worker's tokenizer (or --tokenizer's), once it is known to tokenise as the target does."""
    if config.tokenizer:
        tokenizer, source = Tokenizer.from_files(config.tokenizer), repr(config.tokenizer)
    elif info.HasField("tokenizer") and info.tokenizer.tokenizer_json:
        tokenizer, source = Tokenizer(tokenizer_spec_from_proto(info.tokenizer)), "the target worker's"
    else:
        raise TokenizerMismatch(f"the target worker ({info.model!r}) sends no tokenizer; point --tokenizer at its model folder")
    if tokenizer.fingerprint() != info.tokenizer_fingerprint:
        raise TokenizerMismatch(
            f"the coordinator's tokenizer {source} differs from the target worker's ({info.model!r}); "
            "point --tokenizer at the target model"
        )
    # The target's own probes, whichever tokenizer the coordinator uses (--tokenizer's files may
    # lack what transformers sets up at load, such as the special tokens it adds).
    mismatches = tokenizer.probe_mismatches(tokenizer_probes_from_proto(info.tokenizer.probes))
    if mismatches:
        raise TokenizerMismatch(f"the coordinator does not tokenise as the target worker ({info.model!r}) does: " + "; ".join(mismatches))
    return tokenizer


async def connect(config: CoordinatorConfig, servicer: CoordinatorServicer) -> None:
    """Learn the target's facts and tokenizer; refuse a draft whose tokenizer differs."""
    info = await wait_for_target(servicer.target, config.startup_timeout_s)
    tokenizer = await asyncio.to_thread(coordinator_tokenizer, config, info)
    if servicer.draft is not None:
        servicer.draft.expected_fingerprint = info.tokenizer_fingerprint
        if not await servicer.draft.check(timeout_s=5.0) and servicer.draft.rejected_reason:
            raise TokenizerMismatch(servicer.draft.rejected_reason)
        if servicer.draft.info is None:
            log.warning("no draft worker yet (%s); decoding target-only until it is back", servicer.draft.last_error)
    facts = TargetFacts(
        model=info.model,
        tokenizer=tokenizer,
        vocab_size=info.vocab_size,
        context_length=info.context_length,
        eos_token_ids=frozenset(info.eos_token_ids),
        default_sampling=sampling_from_proto(info.default_sampling, SamplingSettings()),
        tensor_parallel=info.tensor_parallel,
        max_sessions=info.max_sessions,
    )
    profile = profile_for(info.backend or info.device, config.profile_overrides())
    log.info("the target serves on %s: speculating with %s", info.backend or info.device, profile)
    servicer.connected(facts, profile)


def worker_links(config: CoordinatorConfig, client_interceptors: list) -> tuple[TargetLink, DraftLink | None]:
    """The links to the target worker and (unless --draft-address is empty) the draft worker."""
    worker_credentials = channel_credentials(
        config.worker_tls_ca_file, config.worker_tls_cert_file, config.worker_tls_key_file, prefix="--worker-tls"
    )
    target = TargetLink(
        config.target_address, config.worker_timeout_s, client_interceptors, worker_credentials, config.worker_call_tokens,
        config.session_wait_s,
    )
    if not config.draft_address:
        return target, None
    draft = DraftLink(
        config.draft_address,
        config.worker_timeout_s,
        config.draft_retry_s,
        client_interceptors,
        worker_credentials,
        config.worker_call_tokens,
    )
    return target, draft


async def start_coordinator(
    config: CoordinatorConfig,
    interceptors: list | None = None,
    client_interceptors: list | None = None,
    tracer_provider=None,
) -> RunningService:
    """tracer_provider: None builds one from the OTEL_* env vars. The public service gets no
    tracing interceptor (its llm_request span is the server span, see round_trace.py);
    client_interceptors=None joins worker calls to the request's trace."""
    credentials = server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    token = read_token(config.auth_token_file) if config.auth_token_file else None
    if token is not None:
        interceptors = [BearerTokenInterceptor(token, SERVICE_NAME), *(interceptors or [])]
    provider = tracer_provider or tracer_provider_from_env(SERVICE_NAMES["coordinator"])
    if client_interceptors is None:
        client_interceptors = traced_client_interceptors(provider)
    target, draft = worker_links(config, client_interceptors)
    servicer = CoordinatorServicer(config, target, draft, get_tracer(provider), CoordinatorMetrics())
    servicer.metrics.track_admission(servicer.admission)
    servicer.metrics.track_session_wait(target.session_wait)
    server, port, health_state = create_server(
        config.host,
        config.port,
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
        [SERVICE_NAME],
        interceptors,
        credentials,
    )
    service = RunningService(server, port, health_state, thread=None)
    service.servicer = servicer
    if draft is not None:
        service.closers.append(draft.stop_probe)  # a draft that is down is probed until the service stops
    service.tracer_provider = provider
    service.closers.append(servicer.close)
    if config.http_port >= 0:  # first: a port that is taken leaves no other server of this service behind
        service.http = await start_http(servicer, config, token, health_state.gate)
        service.closers.insert(0, service.http.stop)  # before the servicer's threads stop: its requests end first
    servicer.metrics.serve_for(service, config.host, config.metrics_port)
    await health_state.set(NOT_SERVING)
    await server.start()

    async def become_ready() -> None:
        await connect(config, servicer)
        await health_state.set(SERVING)
        log.info("coordinator serving on port %d", port)

    service.ready = asyncio.ensure_future(become_ready())
    return service


async def serve(config: CoordinatorConfig) -> None:
    service = await start_coordinator(config)
    log.info("coordinator started on %s:%d", config.host, service.port)
    await service.serve_until_signal(config.shutdown_grace_s)
