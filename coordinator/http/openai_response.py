"""What a specd request produced, in OpenAI's response shapes: a chat.completion or text_completion,
their streamed chunks, `usage`, and specd's own `specd` field (request id, trace id, speculation stats)."""

from __future__ import annotations

import dataclasses
import time

from google.protobuf import json_format

from coordinator.http.openai_request import CHAT
from coordinator.output import Chunk, Finish
from coordinator.round_trace import FINISH_REASONS
from specd.v1 import coordinator_pb2


@dataclasses.dataclass
class Completion:
    """One request's answer being written: what every object or chunk of it repeats."""

    kind: str  # CHAT or COMPLETION
    model: str
    request_id: str
    trace_id: str
    include_usage: bool = False  # stream_options.include_usage: every chunk says "usage": null, the last its usage
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    streamed_chars: int = 0  # text streamed so far: where the next chunk's text_offsets start

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == CHAT else "cmpl-") + self.request_id

    def _object(self, object_name: str, choices: list, **fields) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices,
                **fields}

    def response(self, finish: Finish, token_texts: list[str] | None) -> dict:
        """The whole answer (stream: false)."""
        if self.kind == CHAT:
            choice = {"index": 0, "message": {"role": "assistant", "content": finish.text}}
        else:
            choice = {"index": 0, "text": finish.text}
        choice["logprobs"] = self._logprobs(finish.logprobs, token_texts)
        choice["finish_reason"] = FINISH_REASONS.get(finish.finish_reason)
        name = "chat.completion" if self.kind == CHAT else "text_completion"
        return self._object(name, [choice], usage=usage(finish.usage), specd=self.specd(finish))

    def first_chunk(self) -> dict | None:
        """A chat stream opens with the assistant's role, as OpenAI's does."""
        if self.kind != CHAT:
            return None
        return self._chunk({"delta": {"role": "assistant", "content": ""}})

    def chunk(self, chunk: Chunk, token_texts: list[str] | None) -> dict:
        """The text (and tokens) one round made final."""
        text = {"delta": {"content": chunk.text}} if self.kind == CHAT else {"text": chunk.text}
        logprobs = self._logprobs(chunk.logprobs, token_texts, self.streamed_chars)
        self.streamed_chars += len(chunk.text)
        return self._chunk({**text, "logprobs": logprobs})

    def last_chunk(self, finish: Finish) -> dict:
        """How the request ended, with specd's stats (and no text: every chunk before has it)."""
        text = {"delta": {}} if self.kind == CHAT else {"text": ""}
        chunk = self._chunk({**text, "finish_reason": FINISH_REASONS.get(finish.finish_reason)})
        chunk["specd"] = self.specd(finish)
        return chunk

    def usage_chunk(self, finish: Finish) -> dict:
        """stream_options.include_usage: a last chunk with no choices and the request's usage."""
        return self._object(self._chunk_object, [], usage=usage(finish.usage))

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == CHAT else "text_completion"

    def _chunk(self, fields: dict) -> dict:
        usage_field = {"usage": None} if self.include_usage else {}
        return self._object(self._chunk_object, [{"index": 0, "logprobs": None, "finish_reason": None, **fields}], **usage_field)

    def _logprobs(self, logprobs: list[float], token_texts: list[str] | None, first_offset: int = 0) -> dict | None:
        """The chosen tokens' logprobs (None when the request did not ask for them); a completion's
        text offsets count from `first_offset`, the characters of the answer before these tokens."""
        if token_texts is None:
            return None
        if self.kind == CHAT:
            return {"content": [
                {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass")), "top_logprobs": []}
                for text, logprob in zip(token_texts, logprobs)
            ]}
        offsets, offset = [], first_offset
        for text in token_texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": token_texts, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}

    def specd(self, finish: Finish) -> dict:
        """specd's extra field: what a gRPC GenerateResponse says besides the text."""
        stats = json_format.MessageToDict(
            finish.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        stats["mode"] = coordinator_pb2.SpeculationMode.Name(finish.stats.mode).removeprefix("SPECULATION_MODE_").lower()
        return {"request_id": self.request_id, "trace_id": self.trace_id, "stop_reason": finish.stop_reason, "stats": stats}


def usage(message: coordinator_pb2.Usage) -> dict:
    return {"prompt_tokens": message.prompt_tokens, "completion_tokens": message.completion_tokens,
            "total_tokens": message.total_tokens}
