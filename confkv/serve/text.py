"""Token ids to text, incrementally, with stop strings (the server's streamed deltas)."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Decodes a growing list of token ids and hands out only the text that is final.

    Text is held back while it ends in an incomplete UTF-8 sequence (a byte-level token that is
    half a character decodes to U+FFFD) or in a prefix of a stop string; once a stop string
    appears, the text ends right before it.
    """

    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.sent = 0
        self.stopped = False
        self.text = ""

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def stop_index(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def reached_stop(self, tokens: list[int]) -> bool:
        """Whether the text of ``tokens`` contains a stop string (the engine's check after each token)."""
        return bool(self.stop) and self.stop_index(self.decode(tokens)) is not None

    def update(self, tokens: list[int], final: bool = False) -> str:
        """The new final text after ``tokens`` (all generated so far); ``final``: nothing more comes."""
        if self.stopped:
            return ""
        full = self.decode(tokens)
        end = self.stop_index(full)
        if end is not None:
            self.stopped, final, full = True, True, full[:end]
        safe = len(full)
        if not final:
            if full.endswith("\ufffd"):
                safe = len(full.rstrip("\ufffd"))
            for s in self.stop:
                for k in range(min(len(s) - 1, safe), 0, -1):
                    if full[:safe].endswith(s[:k]):
                        safe -= k
                        break
        safe = max(safe, self.sent)
        delta = full[self.sent:safe]
        self.sent = safe
        self.text = full[:safe]
        return delta
