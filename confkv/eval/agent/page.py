"""Pages as accessibility trees with numbered elements, and their scrolled text rendering.

The rendering follows WebArena's text observation (Zhou et al., 2024): one node per line,
``[id] role 'name'``, ids numbering every node of the page. The header (site navigation)
is always shown; the body is shown one screen at a time (``scroll down|up``), a screen
being as many body nodes as fit in :data:`SCREEN_CHARS` characters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: characters of body text per screen (about 250-300 SmolLM2 tokens)
SCREEN_CHARS = 520


@dataclass(frozen=True)
class Element:
    """One node. role: link, button, textbox, radio, checkbox, heading, text, ...

    target: what activating it does (a link's url, a button's command, a textbox's field key).
    value: a textbox's text; checked: a radio's or checkbox's state (None: not checkable).
    """

    role: str
    name: str
    target: str = ""
    value: str = ""
    checked: bool | None = None
    depth: int = 1

    @property
    def interactive(self) -> bool:
        return self.role in ("link", "button", "textbox", "radio", "checkbox", "searchbox")

    def line(self, number: int) -> str:
        text = f"{'  ' * self.depth}[{number}] {self.role} '{self.name}'"
        if self.role in ("textbox", "searchbox"):
            text += f" value: '{self.value}'" if self.value else " value: ''"
        if self.checked is not None:
            text += f" checked: {'true' if self.checked else 'false'}"
        return text


@dataclass
class Page:
    """A page: its url and title, the header nodes (always shown) and the body nodes (scrolled)."""

    url: str
    title: str
    header: list[Element] = field(default_factory=list)
    body: list[Element] = field(default_factory=list)

    def elements(self) -> list[Element]:
        """All nodes in id order (header first); node ``i`` has id ``i + 1``."""
        return self.header + self.body

    def spans(self) -> list[tuple[int, int]]:
        """Body index range [begin, end) of each screen; the last screen is moved up to be a full screen."""
        sizes = [len(element.name) + 24 for element in self.body]
        starts, used = [0], 0
        for index, size in enumerate(sizes):
            if used and used + size > SCREEN_CHARS:
                starts.append(index)
                used = 0
            used += size
        spans = [(b, e) for b, e in zip(starts, starts[1:] + [len(sizes)])]
        if len(spans) > 1:
            begin, end = spans[-1]
            tail = sum(sizes[begin:end])
            while begin > spans[-2][0] + 1 and tail + sizes[begin - 1] <= SCREEN_CHARS:
                begin -= 1
                tail += sizes[begin]
            spans[-1] = (begin, end)
        return spans

    def screens(self) -> list[int]:
        """Body index where each screen starts."""
        return [b for b, _ in self.spans()]

    def visible_ids(self, screen: int) -> set[int]:
        """Ids shown on screen number ``screen`` (header and that screen of the body)."""
        begin, end = self._span(screen)
        return set(range(1, len(self.header) + 1)) | {len(self.header) + 1 + i for i in range(begin, end)}

    def _span(self, screen: int) -> tuple[int, int]:
        spans = self.spans()
        return spans[max(0, min(screen, len(spans) - 1))]

    def render(self, screen: int = 0) -> str:
        """The text observation of screen ``screen``."""
        starts = self.screens()
        screen = max(0, min(screen, len(starts) - 1))
        begin, end = self._span(screen)
        lines = [f"[0] RootWebArea '{self.title}' url: {self.url}"]
        lines += [e.line(i + 1) for i, e in enumerate(self.header)]
        if screen > 0:
            lines.append("  (more above: scroll up)")
        offset = len(self.header) + 1
        lines += [self.body[i].line(offset + i) for i in range(begin, end)]
        if screen + 1 < len(starts):
            lines.append("  (more below: scroll down)")
        return "\n".join(lines)

    def find(self, role: str, name: str) -> int | None:
        """Id of the first node with this role and name (exact), or None."""
        for index, element in enumerate(self.elements()):
            if element.role == role and element.name == name:
                return index + 1
        return None

    def screen_of(self, element_id: int) -> int | None:
        """The first screen showing ``element_id`` (header ids: None, shown on every screen)."""
        if element_id <= len(self.header):
            return None
        body_index = element_id - len(self.header) - 1
        return min(i for i, (b, e) in enumerate(self.spans()) if b <= body_index < e)
