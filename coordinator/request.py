"""Turn a public GenerateRequest into a checked, fully resolved plan, or say what to change."""

from __future__ import annotations

import dataclasses
import secrets

from coordinator.config import MAX_SPECULATIVE_TOKENS, CoordinatorConfig
from coordinator.tokenizer import Tokenizer
from specd.core.errors import InvalidRequest
from specd.core.sampling import SamplingSettings
from specd.v1 import coordinator_pb2
from specd.wire.checks import check_id_length, check_token_ids
from specd.wire.convert import sampling_from_proto
from specd.wire.modes import MODES, mode_name

# Stop strings are searched for after every token: a bounded number of bounded strings.
MAX_STOP_STRINGS = 32
MAX_STOP_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class TargetFacts:
    """What the coordinator knows of the target worker and its tokenizer."""

    model: str
    tokenizer: Tokenizer
    vocab_size: int
    context_length: int
    eos_token_ids: frozenset[int]
    default_sampling: SamplingSettings
    tensor_parallel: int
    max_sessions: int = 0  # the target worker's session cap (0: it did not say)


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


def check(request: coordinator_pb2.GenerateRequest, target: TargetFacts, config: CoordinatorConfig, default_k: int) -> None:
    """Every check that needs no tokenising, sizes first. The coordinator runs it before the
    request queues for a place: bad input gets INVALID_ARGUMENT at once, never "retry later"
    from a full server, and no place is held for it."""
    check_id_length(request.request_id, "request_id")
    _check_input(request, target, config.max_prompt_bytes)
    _max_new_tokens(request, config)
    sampling_from_proto(request.sampling, target.default_sampling)
    _check_stop(request.stop)
    _num_speculative_tokens(request.speculation, default_k)


def resolve(request: coordinator_pb2.GenerateRequest, target: TargetFacts, config: CoordinatorConfig, default_k: int) -> ResolvedRequest:
    """A request that passed check(), its prompt tokenised: CPU work a caller sizes, so run it off
    the event loop. (check() counted the prompt's bytes before any tokenising; not again here.)"""
    prompt_ids = _prompt_ids(request, target)
    _check_prompt_length(len(prompt_ids), target.context_length)
    defaults = dataclasses.replace(target.default_sampling, seed=secrets.randbits(63))
    return ResolvedRequest(
        request_id=request.request_id or secrets.token_hex(8),
        prompt_ids=prompt_ids,
        sampling=sampling_from_proto(request.sampling, defaults),
        max_new_tokens=_max_new_tokens(request, config),
        stop_strings=list(request.stop),
        ignore_eos=request.ignore_eos,
        mode=mode_name(request.speculation.mode),
        num_speculative_tokens=_num_speculative_tokens(request.speculation, default_k),
        return_logprobs=request.return_logprobs,
    )


def _max_new_tokens(request: coordinator_pb2.GenerateRequest, config: CoordinatorConfig) -> int:
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else config.default_max_new_tokens
    if max_new <= 0:
        raise InvalidRequest(f"max_new_tokens must be > 0, got {max_new}")
    if max_new > config.max_new_tokens_limit:
        raise InvalidRequest(f"max_new_tokens must be <= {config.max_new_tokens_limit}, got {max_new}")
    return max_new


def _num_speculative_tokens(spec: coordinator_pb2.SpeculationParams, default_k: int) -> int:
    if spec.mode not in coordinator_pb2.SpeculationMode.values():
        raise InvalidRequest(f"speculation.mode {spec.mode} is not one of {', '.join(MODES)}")
    k = spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else default_k
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InvalidRequest(
            f"speculation.num_speculative_tokens must lie in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"
        )
    return k


def _check_prompt_length(tokens: int, context_length: int) -> None:
    if tokens >= context_length:
        raise InvalidRequest(
            f"prompt has {tokens} tokens but the model's context length is {context_length}: shorten the prompt"
        )


def _check_stop(stop) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop: {len(stop)} stop strings; at most {MAX_STOP_STRINGS}")
    if any(not s for s in stop):
        raise InvalidRequest("stop: stop strings must be non-empty")
    longest = max((len(s.encode("utf-8", "surrogatepass")) for s in stop), default=0)
    if longest > MAX_STOP_BYTES:
        raise InvalidRequest(f"stop: a stop string of {longest} bytes; at most {MAX_STOP_BYTES}")


def _check_prompt_bytes(size: int, limit: int, field: str) -> None:
    if size > limit:
        raise InvalidRequest(f"{field} is {size} bytes; at most {limit} (--max-prompt-bytes)")


def _check_input(request: coordinator_pb2.GenerateRequest, target: TargetFacts, max_bytes: int) -> None:
    """The prompt, token ids or messages present and within their sizes (bytes before anything else)."""
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequest("prompt is empty: set one of prompt, prompt_token_ids or messages")
    if which == "prompt":
        if not request.prompt:
            raise InvalidRequest("prompt is empty")
        _check_prompt_bytes(len(request.prompt.encode("utf-8", "surrogatepass")), max_bytes, "prompt")
    elif which == "prompt_token_ids":
        ids = request.prompt_token_ids.ids
        if not ids:
            raise InvalidRequest("prompt_token_ids is empty")
        _check_prompt_length(len(ids), target.context_length)  # before looking at each id
        check_token_ids(ids, target.vocab_size, "prompt_token_ids")
    else:
        _check_messages(request.messages.messages, target, max_bytes)


def _prompt_ids(request: coordinator_pb2.GenerateRequest, target: TargetFacts) -> list[int]:
    """The checked input as token ids: the prompt tokenised, or the messages rendered and tokenised."""
    which = request.WhichOneof("input")
    if which == "prompt":
        return list(target.tokenizer.encode(request.prompt, add_special_tokens=True))
    if which == "prompt_token_ids":
        return list(request.prompt_token_ids.ids)
    return _message_ids(request.messages.messages, target)


# The roles OpenAI's chat API takes that a chat template renders: chat templates handle system,
# user and assistant, and tool (a tool's result; Qwen's template wraps it in <tool_response>).
# "developer" is left out: OpenAI's stand-in for "system" on its own models, which templates
# (Qwen3's among them) do not know and would drop without a word.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def _check_messages(chat, target: TargetFacts, max_bytes: int) -> None:
    if not chat:
        raise InvalidRequest("messages is empty")
    if any(not m.role for m in chat):
        raise InvalidRequest("messages: every message needs a role")
    unknown = next((m.role for m in chat if m.role not in CHAT_ROLES), None)
    if unknown is not None:
        raise InvalidRequest(f"messages: role {unknown[:64]!r} is not one of {', '.join(CHAT_ROLES)}"
                             + ("; send a developer's instructions as role system" if unknown == "developer" else ""))
    if not any(m.content for m in chat):
        raise InvalidRequest("messages: every message's content is empty; a chat needs some text, as a prompt does")
    size = sum(len(m.role.encode("utf-8", "surrogatepass")) + len(m.content.encode("utf-8", "surrogatepass")) for m in chat)
    _check_prompt_bytes(size, max_bytes, "messages (roles and contents together)")
    if not getattr(target.tokenizer, "chat_template", None):
        raise InvalidRequest("messages: the target's tokenizer has no chat template; send a prompt instead")


def _message_ids(chat: list[coordinator_pb2.ChatMessage], target: TargetFacts) -> list[int]:
    """The chat messages rendered with the tokenizer's chat template, then tokenised."""
    messages = [{"role": m.role, "content": m.content} for m in chat]
    try:
        rendered = target.tokenizer.apply_chat_template(messages)
    except Exception as exc:  # noqa: BLE001 - a template error is the caller's to fix
        raise InvalidRequest(f"messages: the chat template failed: {exc}") from None
    ids = list(target.tokenizer.encode(rendered, add_special_tokens=False))
    if not ids:
        raise InvalidRequest("messages render to an empty prompt")
    return ids
