"""What a request has produced: its committed tokens and text, the chunks streamed, how it ended."""

from __future__ import annotations

import dataclasses
import time

from coordinator.text import TextAssembler
from specd.v1 import coordinator_pb2


@dataclasses.dataclass
class Chunk:
    """Tokens committed by one round, and the text that became final with them."""

    token_ids: list[int]
    logprobs: list[float]
    text: str


@dataclasses.dataclass
class Finish:
    finish_reason: int
    stop_reason: str
    text: str  # the whole generated text
    token_ids: list[int]
    logprobs: list[float]
    usage: coordinator_pb2.Usage
    stats: coordinator_pb2.SpeculationStats

    def response_fields(self, request_id: str, trace_id: str) -> dict:
        """The fields the unary GenerateResponse and the stream's last message share."""
        return dict(
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            usage=self.usage,
            stats=self.stats,
            request_id=request_id,
            trace_id=trace_id,
        )


def settle_text(tokens: list[int], text: TextAssembler, eos_ids: frozenset[int]) -> tuple[list[int], str]:
    """Add a round's tokens to the text up to the first stop condition; (tokens to commit, stop reason).

    Runs on a text thread: it decodes, whose cost grows with the tokens and stop strings."""
    for count, token in enumerate(tokens, 1):
        if text.add(token):
            return tokens[:count], text.stop_string
        if token in eos_ids:
            return tokens[:count], "eos"
    return tokens, ""


@dataclasses.dataclass
class RequestOutput:
    """The output side of one request, as rounds commit tokens."""

    text: TextAssembler
    prompt_len: int
    started: float = dataclasses.field(default_factory=time.perf_counter)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    streamed: int = 0  # characters of text sent in chunks so far
    first_token_s: float | None = None
    finish_reason: int = coordinator_pb2.FINISH_REASON_LENGTH
    stop_reason: str = ""
    done: bool = False

    def commit(self, committed: list[int], logprobs: list[float], stop_reason: str, at_max_len: bool) -> Chunk:
        """One round's settled tokens (settle_text) and their logprobs: the chunk they make final."""
        if stop_reason:
            self.stop_reason = stop_reason
            self.finish_reason = coordinator_pb2.FINISH_REASON_STOP
        self.logprobs.extend(logprobs)
        self.done = bool(stop_reason) or at_max_len
        # Text that a stop string may still cut off is held back until the request ends.
        end = len(self.text.text) if self.done else self.text.streamable_length()
        if self.first_token_s is None and committed:
            self.first_token_s = time.perf_counter() - self.started
        chunk = Chunk(committed, logprobs, self.text.text[self.streamed:end])
        self.streamed = max(self.streamed, end)
        return chunk

    def finish(self, token_ids: list[int], stats: coordinator_pb2.SpeculationStats) -> Finish:
        completion = len(token_ids)
        return Finish(
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            text=self.text.text,
            token_ids=token_ids,
            logprobs=self.logprobs,
            usage=coordinator_pb2.Usage(
                prompt_tokens=self.prompt_len, completion_tokens=completion, total_tokens=self.prompt_len + completion
            ),
            stats=stats,
        )
