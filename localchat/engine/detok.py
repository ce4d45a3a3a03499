"""Incremental detokenization: emit text as tokens arrive, never half a UTF-8 character."""

from __future__ import annotations


class StreamDecoder:
    """Decodes a growing list of ids; `push` returns only the new, complete text."""

    def __init__(self, tokenizer, window: int = 8):
        self.tokenizer = tokenizer
        self.window = window  # tokens of context kept for decoding (spaces depend on the previous token)
        self.ids: list[int] = []
        self.prefix = 0  # start of the decoding window
        self.read = 0  # ids before this index have been emitted

    def _text(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._text(self.prefix, self.read)
        after = self._text(self.prefix, len(self.ids))
        if after.endswith("\ufffd") or not after.startswith(before):
            return ""  # an incomplete character: wait for the next token
        self.read = len(self.ids)
        if self.read - self.prefix > self.window:
            self.prefix = self.read - self.window
        return after[len(before) :]

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)
