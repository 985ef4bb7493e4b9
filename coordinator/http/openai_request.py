"""An OpenAI-style request body (chat or completion) as a specd GenerateRequest, or a 400 naming the field.

Only the shapes are checked here (types, and what the wire can carry); the values are checked where
a gRPC request's are (coordinator/request.py), so both APIs refuse the same requests alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from coordinator.http.errors import bad_request
from specd.v1 import common_pb2, coordinator_pb2
from specd.wire.modes import MODES, mode_value

CHAT, COMPLETION = "chat", "completion"
INT32_MAX = 2**31 - 1
# OpenAI fields specd has no counterpart for: refused unless they hold their "off" value, so that
# a request is never served as if they had been applied.
_UNSUPPORTED = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    # vLLM's sampling and output extras: accepted at their "off" value only.
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "prompt_logprobs": (None, 0),
    "truncate_prompt_tokens": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "parallel_tool_calls": (None, False),
}


@dataclasses.dataclass(frozen=True)
class ApiRequest:
    """The GenerateRequest a body asks for, and how it wants its answer."""

    generate: coordinator_pb2.GenerateRequest
    model: str | None
    stream: bool
    include_usage: bool


def parse_body(body: Any, kind: str) -> ApiRequest:
    """The body of POST /v1/chat/completions (kind CHAT) or /v1/completions (COMPLETION)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _refuse_unsupported(body)
    _check_choices(body)
    message = coordinator_pb2.GenerateRequest(
        sampling=_sampling(body),
        stop=_stop(body),
        ignore_eos=bool(_field(body, "ignore_eos", bool)),
        speculation=_speculation(body),
        return_logprobs=_wants_logprobs(body, kind),
    )
    if kind == CHAT:
        message.messages.CopyFrom(_messages(body))
    else:
        _set_prompt(message, body)
    max_tokens = _max_tokens(body)
    if max_tokens is not None:
        message.max_new_tokens = max_tokens
    stream = bool(_field(body, "stream", bool))
    options = _field(body, "stream_options", dict)
    if options is not None and not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    include_usage = bool(_field(options or {}, "include_usage", bool, "stream_options.include_usage"))
    return ApiRequest(message, _field(body, "model", str), stream, include_usage)


def _field(body: dict, name: str, kind: type | tuple, param: str | None = None):
    """body[name] if it is of `kind` (a bool is never a number here), None if absent or null."""
    value = body.get(name)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        value = object()  # true/false where a number is wanted: refused below
    if not isinstance(value, kinds):
        wanted = " or ".join({bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                              list: "an array", dict: "an object"}[k] for k in kinds)
        raise bad_request(f"{param or name} must be {wanted}", param or name)
    return value


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    value = _field(body, name, int)
    if value is not None and not low <= value <= high:
        raise bad_request(f"{name} must lie in [{low}, {high}], got {value}", name)
    return value


def _refuse_unsupported(body: dict) -> None:
    for name, off in _UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise bad_request(f"{name} is not supported by specd; leave it out", name)
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise bad_request("response_format: specd writes text only; leave it out", "response_format")


def _check_choices(body: dict) -> None:
    if _field(body, "n", int) not in (None, 1):
        raise bad_request("n: specd answers one choice per request; n must be 1", "n")


def _max_tokens(body: dict) -> int | None:
    """max_completion_tokens (OpenAI's newer name), else max_tokens; unset: the coordinator's default,
    whose --max-new-tokens-limit bounds it from above."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = _integer(body, name, 1, INT32_MAX)
        if value is not None:
            return value
    return None


def _sampling(body: dict) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams()
    for name in ("temperature", "top_p", "repetition_penalty"):
        value = _field(body, name, (int, float))
        try:
            if value is not None:
                setattr(sampling, name, float(value))
        except OverflowError:  # an integer past any float: refused as out of range by the value checks
            setattr(sampling, name, float("inf"))
    top_k = _integer(body, "top_k", -1, INT32_MAX)
    if top_k is not None:
        sampling.top_k = max(top_k, 0)  # -1: off, as vLLM has it (0 is off on the wire)
    seed = _integer(body, "seed", 0, 2**64 - 1)
    if seed is not None:
        sampling.seed = seed
    return sampling


def _stop(body: dict) -> list[str]:
    stop = _field(body, "stop", (str, list))
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or an array of strings", "stop")
    return stops


def _speculation(body: dict) -> coordinator_pb2.SpeculationParams:
    """specd's own knobs: speculation_mode (auto, ssd, sd, off) and num_speculative_tokens (K)."""
    speculation = coordinator_pb2.SpeculationParams()
    mode = _field(body, "speculation_mode", str)
    if mode is not None:
        if mode not in MODES:
            raise bad_request(f"speculation_mode must be one of {', '.join(MODES)}", "speculation_mode")
        speculation.mode = mode_value(mode)
    k = _integer(body, "num_speculative_tokens", 0, INT32_MAX)
    if k is not None:
        speculation.num_speculative_tokens = k
    return speculation


def _wants_logprobs(body: dict, kind: str) -> bool:
    """Logprobs of the chosen tokens. Alternatives (top_logprobs) are not computed by specd."""
    if kind == CHAT:
        if _field(body, "top_logprobs", int) not in (None, 0):
            raise bad_request("top_logprobs: specd returns the chosen tokens' logprobs only; use 0", "top_logprobs")
        return bool(_field(body, "logprobs", bool))
    logprobs = _field(body, "logprobs", int)
    if logprobs not in (None, 0):
        raise bad_request("logprobs: specd returns the chosen tokens' logprobs only; use 0", "logprobs")
    return logprobs == 0


def _messages(body: dict) -> coordinator_pb2.ChatMessages:
    messages = _field(body, "messages", list)
    if messages is None:
        raise bad_request("messages is required", "messages")
    chat = coordinator_pb2.ChatMessages()
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"{param} must be an object with a role and a content", param)
        role = _field(message, "role", str, f"{param}.role")
        chat.messages.add(role=role or "", content=_content(message.get("content"), f"{param}.content"))
    return chat


def _content(content: Any, param: str) -> str:
    """A message's text: a string, or an array of text parts (joined), as OpenAI's clients send it."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(text, str) for text in texts):
            return "".join(texts)
    raise bad_request(f"{param} must be a string or an array of text parts ({{\"type\": \"text\", \"text\": ...}})", param)


def _set_prompt(message: coordinator_pb2.GenerateRequest, body: dict) -> None:
    """A completion's prompt: a string or token ids, or an array holding one of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        message.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        if not all(-INT32_MAX <= i <= INT32_MAX for i in prompt):
            raise bad_request("prompt: token ids must lie in the vocabulary", "prompt")
        message.prompt_token_ids.ids.extend(prompt)
    elif prompt is None:
        raise bad_request("prompt is required", "prompt")
    else:
        raise bad_request("prompt must be a string, an array of token ids, or an array of one of them "
                          "(specd answers one prompt per request)", "prompt")
