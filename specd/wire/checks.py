"""Checks of what a call carries that every service applies alike: ids, token ids, committed tails."""

from __future__ import annotations

from specd.core.errors import InvalidRequest
from specd.v1 import common_pb2

# Longest session_id a worker takes, and request_id the coordinator takes (UTF-8 bytes): ids
# are keys and log fields, not payloads, and a request_id is echoed back to its caller.
MAX_ID_BYTES = 256


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
