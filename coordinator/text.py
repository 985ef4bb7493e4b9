"""Incremental detokenisation and stop strings."""

from __future__ import annotations

_CONTEXT_TOKENS = 4  # prompt tokens decoded in front of the output, for tokenizers that strip leading spaces


class TextAssembler:
    """The generated text so far, the earliest stop string in it, and how much is safe to stream."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop_strings: list[str]):
        self._tokenizer = tokenizer
        self._stops = stop_strings
        self._holdback = max((len(s) for s in stop_strings), default=1) - 1
        # Decode a short window, not the whole output, per token: [_prefix, _read) was decoded
        # already and only sets the context (spaces, merged bytes) for what follows it.
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix, self._read = 0, len(self._ids)
        self._settled = ""  # text of the tokens before _read
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_string = ""  # the stop string that ended the text, if any

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> bool:
        """Append one token; True if a stop string now ends the text (it is cut off, and stays so)."""
        self.token_ids.append(token_id)
        if self.stop_string:
            return True
        self._ids.append(token_id)
        # A stop string not found before ends past the text settled before this token. Measured
        # from self.text instead, the window could start too late: byte-fallback decoders (Llama's,
        # Mistral's) show each byte of an unfinished character as its own U+FFFD, so the text
        # before it settles can be longer than after.
        search_from = max(0, len(self._settled) - self._holdback)
        window_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        pending = new_text[len(window_text) :]
        if pending and not pending.endswith("\ufffd"):  # a whole character: settle it
            self._settled += pending
            pending = ""
            self._prefix, self._read = self._read, len(self._ids)
        text = self._settled + pending
        found = [(text.find(s, search_from), s) for s in self._stops]
        found = [(index, s) for index, s in found if index >= 0]
        if found:
            index, self.stop_string = min(found)
            self.text = text[:index]
            return True
        self.text = text
        return False

    def streamable_length(self) -> int:
        """How much of the text cannot change any more: no half character, no possible stop-string start."""
        length = len(self.text)
        while length and self.text[length - 1] == "\ufffd":
            length -= 1
        return max(0, length - self._holdback)
