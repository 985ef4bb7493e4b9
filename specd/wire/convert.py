"""Conversions between the wire (specd.v1 messages) and specd's own types, with their checks."""

from __future__ import annotations

import json
import math
from typing import Iterable

from specd.core.errors import InvalidRequest
from specd.core.sampling import SamplingSettings, SparseDist, sampling_problem
from specd.core.tokenizer_spec import TokenizerProbe, TokenizerSpec
from specd.v1 import common_pb2


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




def sparse_list_from_proto(messages: Iterable[common_pb2.SparseDistribution]) -> list[SparseDist]:
    """Distributions a worker produced (a Propose's, a speculation cache entry's), taken as sent."""
    return [SparseDist(token_ids=list(m.token_ids), probs=list(m.probs)) for m in messages]


def tokenizer_spec_to_proto(spec: TokenizerSpec) -> common_pb2.TokenizerSpec:
    return common_pb2.TokenizerSpec(
        tokenizer_json=spec.tokenizer_json,
        chat_template=spec.chat_template,
        template_variables_json=json.dumps(dict(spec.template_variables), ensure_ascii=False),
        clean_up_tokenization_spaces=spec.clean_up_tokenization_spaces,
        probes=[
            common_pb2.TokenizerProbe(
                text=probe.text,
                chat_json=json.dumps([{"role": r, "content": c} for r, c in probe.chat], ensure_ascii=False) if probe.chat else "",
                token_ids=probe.token_ids,
                decoded=probe.decoded,
            )
            for probe in spec.probes
        ],
        split_special_tokens=spec.split_special_tokens,
    )


def tokenizer_spec_from_proto(message: common_pb2.TokenizerSpec) -> TokenizerSpec:
    return TokenizerSpec(
        tokenizer_json=message.tokenizer_json,
        chat_template=message.chat_template,
        template_variables=json.loads(message.template_variables_json or "{}"),
        clean_up_tokenization_spaces=message.clean_up_tokenization_spaces,
        probes=tokenizer_probes_from_proto(message.probes),
        split_special_tokens=message.split_special_tokens,
    )


def tokenizer_probes_from_proto(messages: Iterable[common_pb2.TokenizerProbe]) -> tuple[TokenizerProbe, ...]:
    return tuple(
        TokenizerProbe(
            tuple(probe.token_ids),
            text=probe.text,
            chat=tuple((m["role"], m["content"]) for m in json.loads(probe.chat_json)) if probe.chat_json else (),
            decoded=probe.decoded,
        )
        for probe in messages
    )
