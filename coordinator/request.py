"""Turn a public GenerateRequest into a checked, fully resolved plan, or say what to change."""

from __future__ import annotations

import dataclasses
import secrets

from coordinator.config import MAX_SPECULATIVE_TOKENS, CoordinatorConfig
from specd.sampling import SamplingSettings
from specd.serving import InvalidRequest
from specd.v1 import coordinator_pb2
from specd.wire import check_token_ids, sampling_from_proto

MODE_NAMES = {
    coordinator_pb2.SPECULATION_MODE_AUTO: "auto",
    coordinator_pb2.SPECULATION_MODE_SSD: "ssd",
    coordinator_pb2.SPECULATION_MODE_SD: "sd",
    coordinator_pb2.SPECULATION_MODE_OFF: "off",
}
MODE_VALUES = {name: value for value, name in MODE_NAMES.items()}


@dataclasses.dataclass(frozen=True)
class TargetFacts:
    """What the coordinator knows of the target worker and its tokenizer."""

    model: str
    tokenizer: object
    vocab_size: int
    context_length: int
    eos_token_ids: frozenset[int]
    default_sampling: SamplingSettings
    tensor_parallel: int


@dataclasses.dataclass(frozen=True)
class ResolvedRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSettings
    max_new_tokens: int
    stop_strings: list[str]
    ignore_eos: bool
    mode: str  # as asked: auto, ssd, sd or off
    num_speculative_tokens: int
    return_logprobs: bool


def resolve(request: coordinator_pb2.GenerateRequest, target: TargetFacts, config: CoordinatorConfig) -> ResolvedRequest:
    prompt_ids = _prompt_ids(request, target)
    if len(prompt_ids) >= target.context_length:
        raise InvalidRequest(
            f"prompt has {len(prompt_ids)} tokens but the model's context length is "
            f"{target.context_length}: shorten the prompt"
        )
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else config.default_max_new_tokens
    if max_new <= 0:
        raise InvalidRequest(f"max_new_tokens must be > 0, got {max_new}")
    if max_new > config.max_new_tokens_limit:
        raise InvalidRequest(f"max_new_tokens must be <= {config.max_new_tokens_limit}, got {max_new}")
    defaults = dataclasses.replace(target.default_sampling, seed=secrets.randbits(63))
    sampling = sampling_from_proto(request.sampling, defaults)
    if any(not s for s in request.stop):
        raise InvalidRequest("stop: stop strings must be non-empty")
    spec = request.speculation
    if spec.mode not in MODE_NAMES:
        raise InvalidRequest(f"speculation.mode {spec.mode} is not one of auto, ssd, sd, off")
    k = spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else config.num_speculative_tokens
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InvalidRequest(
            f"speculation.num_speculative_tokens must lie in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"
        )
    return ResolvedRequest(
        request_id=request.request_id or secrets.token_hex(8),
        prompt_ids=prompt_ids,
        sampling=sampling,
        max_new_tokens=max_new,
        stop_strings=list(request.stop),
        ignore_eos=request.ignore_eos,
        mode=MODE_NAMES[spec.mode],
        num_speculative_tokens=k,
        return_logprobs=request.return_logprobs,
    )


def _prompt_ids(request: coordinator_pb2.GenerateRequest, target: TargetFacts) -> list[int]:
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequest("prompt is empty: set one of prompt, prompt_token_ids or messages")
    if which == "prompt":
        if not request.prompt:
            raise InvalidRequest("prompt is empty")
        return list(target.tokenizer.encode(request.prompt, add_special_tokens=True))
    if which == "prompt_token_ids":
        if not request.prompt_token_ids.ids:
            raise InvalidRequest("prompt_token_ids is empty")
        return check_token_ids(request.prompt_token_ids.ids, target.vocab_size, "prompt_token_ids")
    messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
    if not messages:
        raise InvalidRequest("messages is empty")
    if any(not m["role"] for m in messages):
        raise InvalidRequest("messages: every message needs a role")
    if not getattr(target.tokenizer, "chat_template", None):
        raise InvalidRequest("messages: the target's tokenizer has no chat template; send a prompt instead")
    try:
        rendered = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template error is the caller's to fix
        raise InvalidRequest(f"messages: the chat template failed: {exc}") from None
    ids = list(target.tokenizer.encode(rendered, add_special_tokens=False))
    if not ids:
        raise InvalidRequest("messages render to an empty prompt")
    return ids
