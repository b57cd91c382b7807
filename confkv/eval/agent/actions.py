"""Agent actions and a tolerant parser from model output to an action.

The action space follows WebArena's text observation setting (Zhou et al., 2024,
"WebArena: A Realistic Web Environment for Building Autonomous Agents"):
``click [id]``, ``type [id] "text"``, ``scroll up|down``, ``go back``, ``stop ["answer"]``.

:func:`parse_action` never raises: output it cannot read becomes ``Action("invalid")``,
which the environment counts as a failed step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("click", "type", "scroll", "back", "stop", "invalid")


@dataclass(frozen=True)
class Action:
    """One agent action.

    kind: one of :data:`KINDS`; element: the numbered element (click/type);
    text: typed text, the stop answer, or the scroll direction ("up"/"down");
    raw: the model output it was parsed from (for invalid actions: why it failed).
    """

    kind: str
    element: int | None = None
    text: str = ""
    raw: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action.kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def valid(self) -> bool:
        return self.kind != "invalid"

    def canonical(self) -> str:
        """The action in its one canonical spelling (used for agreement: equal iff same action)."""
        return format_action(self)


def click(element: int) -> Action:
    return Action("click", element=element)


def type_text(element: int, text: str) -> Action:
    return Action("type", element=element, text=text)


def scroll(direction: str) -> Action:
    if direction not in ("up", "down"):
        raise ValueError(f"scroll direction must be 'up' or 'down', got {direction!r}")
    return Action("scroll", text=direction)


def go_back() -> Action:
    return Action("back")


def stop(answer: str = "") -> Action:
    return Action("stop", text=answer)


def format_action(action: Action) -> str:
    """Action -> the text an expert writes (and the model should write)."""
    if action.kind == "click":
        return f"click [{action.element}]"
    if action.kind == "type":
        return f'type [{action.element}] "{action.text}"'
    if action.kind == "scroll":
        return f"scroll {action.text}"
    if action.kind == "back":
        return "go back"
    if action.kind == "stop":
        return f'stop ["{action.text}"]' if action.text else "stop"
    return "invalid"


_FENCE = re.compile(r"```(?:[a-zA-Z]*\n)?(.*?)```", re.S)
_QUOTES = "\"'`\u201c\u201d\u2018\u2019"
_PATTERNS = [
    ("type", re.compile(r"\btype\s*[\[(]?\s*(\d+)\s*[\])]?\s*[,:]?\s*(.*)", re.I)),
    ("click", re.compile(r"\bclick\s*(?:on\s*)?[\[(]?\s*(\d+)\s*[\])]?", re.I)),
    ("scroll", re.compile(r"\bscroll\s*[\[(]?\s*[\"']?(up|down)\b", re.I)),
    ("back", re.compile(r"\bgo[\s_-]*back\b", re.I)),
    ("stop", re.compile(r"\bstop\b[ \t]*(.*)", re.I)),
]


def _clean_text(text: str) -> str:
    """Typed text / answer: one line, surrounding brackets and quotes removed."""
    text = text.strip().splitlines()[0].strip() if text.strip() else ""
    text = re.sub(r"\s*\[[01]\]\s*$", "", text)  # WebArena's trailing [press_enter] flag
    for _ in range(3):
        text = text.strip()
        if len(text) >= 2 and text[0] == "[" and text[-1] == "]":
            text = text[1:-1]
        elif text[:1] == "[" and "]" in text:
            text = text[1:text.rindex("]")]
        text = text.strip()
        if text[:1] in _QUOTES:
            end = max(text.rfind(q) for q in _QUOTES)
            text = text[1:end] if end > 0 else text[1:]
    return text.strip()


def parse_action(output: str) -> Action:
    """Model output -> :class:`Action`; never raises (unreadable output -> ``Action("invalid")``).

    Tolerates code fences and backticks, any case, prose before or after the action
    (the earliest action in the text wins; inside a code fence first), and missing
    brackets (``click 12``) or quotes (``type [3] laptop``).
    """
    if not isinstance(output, str):
        return Action("invalid", raw=f"not text: {type(output).__name__}")
    candidates = [m.group(1) for m in _FENCE.finditer(output)] + [output]
    for text in candidates:
        text = text.replace("`", " ").strip()
        best: tuple[int, Action] | None = None
        for kind, pattern in _PATTERNS:
            match = pattern.search(text)
            if match is None or (best is not None and match.start() >= best[0]):
                continue
            if kind == "click":
                action = Action("click", element=int(match.group(1)), raw=output)
            elif kind == "type":
                action = Action("type", element=int(match.group(1)), text=_clean_text(match.group(2)), raw=output)
            elif kind == "scroll":
                action = Action("scroll", text=match.group(1).lower(), raw=output)
            elif kind == "back":
                action = Action("back", raw=output)
            else:
                action = Action("stop", text=_clean_text(match.group(1)), raw=output)
            best = (match.start(), action)
        if best is not None:
            return best[1]
    return Action("invalid", raw=output)
