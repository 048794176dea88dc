"""Incremental, UTF-8-safe detokenization with stop strings, for streaming.

Decoding each new token alone breaks words (a leading space belongs to its neighbours) and multi-byte characters
(a byte-fallback token may hold half of one). As vLLM does, we decode a short window of earlier tokens with and
without the new ones and emit the difference, holding it back while it ends in U+FFFD (an incomplete character).
Text that might be the start of a stop string is held back too, so that a stop string never reaches a client.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class Detokenizer:
    CONTEXT = 5  # prompt tokens decoded before the output, so its first token keeps its leading space

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 include_stop: bool = False, context: list[int] = ()):
        self.tok, self.skip, self.stop, self.include_stop = tokenizer, skip_special_tokens, stop, include_stop
        self.ids: list[int] = list(context[-self.CONTEXT:]) if self.CONTEXT else []
        self.context = len(self.ids)
        self.prefix, self.read = 0, self.context  # ids[prefix:read] is context already turned into text
        self.text = ""  # all text so far (cut at a stop string once one appears)
        self.sent = 0  # characters of `text` already returned
        self.stopped = False
        self.longest = max((len(s) for s in stop), default=0)  # text held back: a stop string may be starting

    def push(self, ids: list[int]) -> str:
        """Add generated ids; returns the text that may be sent now. Sets `stopped` on a stop string."""
        if self.tok is None or self.stopped:
            return ""
        self.ids.extend(ids)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        after = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if after.endswith(REPLACEMENT) or not after.startswith(before):
            return self._release(final=False)  # wait for the rest of the character
        new = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self._append(new)
        return self._release(final=False)

    def _append(self, new: str) -> None:
        start = max(len(self.text) - self.longest + 1, 0)
        self.text += new
        if not self.stop:
            return
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, start)) >= 0]
        if hits:
            at, s = min(hits)
            self.text = self.text[: at + len(s) if self.include_stop else at]
            self.stopped = True

    def _release(self, final: bool) -> str:
        hold = 0 if final or self.stopped or not self.longest else self.longest - 1
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> str:
        """The rest of the text once the request ends: the whole output decoded at once, so that the streamed
        pieces add up to what a single decode gives."""
        if self.tok is not None and not self.stopped:
            ctx = self.tok.decode(self.ids[:self.context], skip_special_tokens=self.skip)
            full = self.tok.decode(self.ids, skip_special_tokens=self.skip)
            full = full[len(ctx):] if full.startswith(ctx) else self.tok.decode(self.ids[self.context:],
                                                                                skip_special_tokens=self.skip)
            if full.startswith(self.text[: self.sent]):
                self.text = ""
                self._append(full)
        return self._release(final=True)
