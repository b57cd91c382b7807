"""The mail site: inbox listing, message pages, compose, sent folder."""

from __future__ import annotations

from confkv.eval.agent.page import Element, Page
from confkv.eval.agent.sites.common import button, heading, link, nav, text, textbox
from confkv.eval.agent.state import BrowserState
from confkv.eval.agent.world import World

COMPOSE_FIELDS = (("to", "To"), ("subject", "Subject"), ("body", "Message"))


def _header() -> list[Element]:
    return nav([link("Inbox", "mail/", depth=1), link("Compose", "mail/compose", depth=1),
                link("Sent", "mail/sent", depth=1)])


def build(world: World, state: BrowserState, path: str) -> Page | None:
    """Page for ``mail/<path>`` or None when there is no such page."""
    if path == "":
        body = [heading("Inbox"), text(f"{len(world.messages)} messages")]
        for m in world.messages:
            body.append(link(f"{m.sender}: {m.subject}", f"mail/message/{m.mid}"))
        return Page("mail/", "Mail - Inbox", _header(), body)
    if path.startswith("message/"):
        mid = path.split("/", 1)[1]
        try:
            m = world.message(mid)
        except StopIteration:
            return None
        body = [heading(m.subject), text(f"From: {m.sender}"), text(f"Date: {m.date}")]
        body += [text(p) for p in m.body] + [link("Back to inbox", "mail/")]
        return Page(f"mail/{path}", f"Mail - {m.subject}", _header(), body)
    if path == "compose":
        body = [heading("New message")]
        body += [textbox(label, f"compose.{key}", state.fields) for key, label in COMPOSE_FIELDS]
        body.append(button("Send", "send"))
        return Page("mail/compose", "Mail - Compose", _header(), body)
    if path == "sent":
        body = [heading("Sent messages")]
        body += [text(f"To {s['to']}: {s['subject']}") for s in state.sent] or [text("No sent messages.")]
        return Page("mail/sent", "Mail - Sent", _header(), body)
    return None


def send(state: BrowserState) -> str:
    """The compose page's 'Send': records the message and returns the next url (or sets a notice)."""
    f = state.fields
    if not f.get("compose.to"):
        state.notice = "Please fill in: To"
        return state.url
    state.sent.append({key: f.get(f"compose.{key}", "") for key, _ in COMPOSE_FIELDS})
    for key, _ in COMPOSE_FIELDS:
        f.pop(f"compose.{key}", None)
    return "mail/sent"
