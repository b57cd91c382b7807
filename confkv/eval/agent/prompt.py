"""The agent prompt: a short system instruction, the chat template's turns, observation / action alternating.

The history is fed to one streaming cache segment by segment, so the prompt is cut into
pieces that concatenate to the chat template's rendering of the whole conversation:

    first(goal, obs) = head + "OBJECTIVE: <goal>\\n\\n" + obs + after_obs
    next(obs)        = between + obs + after_obs          (after each action)

``head``, ``after_obs`` and ``between`` are read off the tokenizer's chat template (SmolLM2:
``<|im_start|>system ...<|im_end|>\\n<|im_start|>user\\n``, ``<|im_end|>\\n<|im_start|>assistant\\n``,
``<|im_end|>\\n<|im_start|>user\\n``); without a template a plain text format is used.
The objective is stated once, in the first user turn: like the pages read early, it has to
survive in the cache for the rest of the episode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SYSTEM = ("You are a web agent. Each user turn shows the current web page as an accessibility tree with numbered "
          "elements. Reply with one action only: click [id], type [id] \"text\", scroll down, scroll up, go back, "
          "or stop [\"answer\"] when the objective is done.")

_SENTINELS = ("\x01SYS\x01", "\x01U1\x01", "\x01A1\x01", "\x01U2\x01")


@dataclass(frozen=True)
class ChatFormat:
    head: str
    after_obs: str
    between: str

    def first(self, goal: str, observation: str) -> str:
        return f"{self.head}OBJECTIVE: {goal}\n\n{observation}{self.after_obs}"

    def next(self, observation: str) -> str:
        return f"{self.between}{observation}{self.after_obs}"

    @classmethod
    def plain(cls, system: str = SYSTEM) -> "ChatFormat":
        return cls(head=f"{system}\n\nOBSERVATION:\n", after_obs="\nACTION: ", between="\n\nOBSERVATION:\n")

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, system: str = SYSTEM) -> "ChatFormat":
        """The tokenizer's chat template cut into the three pieces (plain text if it has none)."""
        if not getattr(tokenizer, "chat_template", None):
            return cls.plain(system)
        sys_, u1, a1, u2 = _SENTINELS
        messages = [{"role": "system", "content": sys_}, {"role": "user", "content": u1},
                    {"role": "assistant", "content": a1}, {"role": "user", "content": u2}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not all(s in text for s in _SENTINELS):
            return cls.plain(system)
        head = text[:text.index(u1)].replace(sys_, system)
        after_obs = text[text.index(u1) + len(u1):text.index(a1)]
        between = text[text.index(a1) + len(a1):text.index(u2)]
        tail = text[text.index(u2) + len(u2):]
        if tail != after_obs:  # the template must repeat the same assistant opening
            return cls.plain(system)
        return cls(head=head, after_obs=after_obs, between=between)
