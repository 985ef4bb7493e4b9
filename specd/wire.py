"""Conversions between the wire (specd.v1 messages) and specd's own types, with their checks."""

from __future__ import annotations

import math

from specd.sampling import SamplingSettings, SparseDist, sampling_problem
from specd.serving import InvalidRequest
from specd.v1 import common_pb2

# Longest session_id a worker takes, and request_id the coordinator takes (UTF-8 bytes): ids
# are keys and log fields, not payloads, and a request_id is echoed back to its caller.
MAX_ID_BYTES = 256


def sampling_from_proto(message: common_pb2.SamplingParams, defaults: SamplingSettings) -> SamplingSettings:
    """Fill unset fields from `defaults`, then check every value."""
    settings = SamplingSettings(
        temperature=message.temperature if message.HasField("temperature") else defaults.temperature,
        top_k=message.top_k if message.HasField("top_k") else defaults.top_k,
        top_p=message.top_p if message.HasField("top_p") else defaults.top_p,
        seed=message.seed if message.HasField("seed") else defaults.seed,
        repetition_penalty=(
            message.repetition_penalty if message.HasField("repetition_penalty") else defaults.repetition_penalty
        ),
    )
    check_sampling(settings)
    return settings


def check_sampling(settings: SamplingSettings) -> None:
    problem = sampling_problem(settings)
    if problem is not None:
        raise InvalidRequest(problem)


def sampling_to_proto(settings: SamplingSettings) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p, seed=settings.seed,
        repetition_penalty=settings.repetition_penalty,
    )


def sparse_to_proto(dist: SparseDist) -> common_pb2.SparseDistribution:
    return common_pb2.SparseDistribution(token_ids=dist.token_ids, probs=dist.probs)


def sparse_from_proto(message: common_pb2.SparseDistribution, vocab_size: int, field: str) -> SparseDist:
    ids = list(message.token_ids)
    probs = list(message.probs)
    if not ids or len(ids) != len(probs):
        raise InvalidRequest(f"{field}: token_ids and probs must be non-empty and of equal length")
    if len(ids) > vocab_size:
        raise InvalidRequest(f"{field}: {len(ids)} entries for a vocabulary of {vocab_size}")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequest(f"{field}: token ids must lie in [0, {vocab_size})")
    if not all(math.isfinite(p) and p >= 0 for p in probs) or not math.isfinite(sum(probs)) or not sum(probs) > 0:
        raise InvalidRequest(f"{field}: probabilities must be finite and >= 0 with a positive sum")
    return SparseDist(token_ids=ids, probs=probs)


def check_id_length(value: str, field: str) -> None:
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_ID_BYTES:
        raise InvalidRequest(f"{field} is {size} bytes long; at most {MAX_ID_BYTES}")


def check_session_id(session_id: str) -> None:
    if not session_id:
        raise InvalidRequest("session_id is empty")
    check_id_length(session_id, "session_id")


def check_token_ids(ids, vocab_size: int, field: str) -> list[int]:
    ids = list(ids)
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        raise InvalidRequest(f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids


def check_committed(message: common_pb2.CommittedTokens, vocab_size: int, context_length: int, extra: int) -> list[int]:
    """The committed tail's ids, checked; `extra` tokens (a draft) must also fit the context."""
    tokens = check_token_ids(message.token_ids, vocab_size, "committed.token_ids")
    if message.start == 0 and not tokens:
        raise InvalidRequest("committed.token_ids is empty: a session starts with at least one token")
    total = message.start + len(tokens) + extra
    if total > context_length:
        raise InvalidRequest(
            f"{total} tokens exceed the model's context length of {context_length}; send fewer tokens"
        )
    return tokens
