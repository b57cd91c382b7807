"""The navigation header every page shares, and small helpers for building pages."""

from __future__ import annotations

from confkv.eval.agent.page import Element

SITES = (("Shop", "shop/"), ("Wiki", "wiki/"), ("Mail", "mail/"), ("Forms", "forms/"))


def nav(extra: list[Element] | None = None) -> list[Element]:
    """The header: links to the four sites, then the site's own controls."""
    return [Element("link", name, target=f"url:{url}") for name, url in SITES] + list(extra or [])


def text(line: str, depth: int = 2) -> Element:
    return Element("StaticText", line, depth=depth)


def heading(line: str) -> Element:
    return Element("heading", line, depth=1)


def link(name: str, url: str, depth: int = 2) -> Element:
    return Element("link", name, target=f"url:{url}", depth=depth)


def button(name: str, command: str, depth: int = 2) -> Element:
    return Element("button", name, target=f"cmd:{command}", depth=depth)


def textbox(name: str, key: str, fields: dict, depth: int = 2, role: str = "textbox") -> Element:
    return Element(role, name, target=f"field:{key}", value=fields.get(key, ""), depth=depth)


def radio(name: str, group: str, fields: dict, depth: int = 2) -> Element:
    return Element("radio", name, target=f"radio:{group}:{name}", checked=fields.get(group) == name, depth=depth)


def checkbox(name: str, key: str, fields: dict, depth: int = 2) -> Element:
    return Element("checkbox", name, target=f"check:{key}", checked=fields.get(key) == "on", depth=depth)


def sentences(paragraph: str) -> list[str]:
    """A paragraph as one StaticText node per sentence (finer scrolling)."""
    parts = [p.strip() for p in paragraph.replace(". ", ".\n").splitlines() if p.strip()]
    return parts


def footer() -> list:
    """The site footer every page ends with."""
    return [heading("Footer")] + [link(name, "wiki/") for name in ("Help", "About us", "Privacy policy",
                                                                   "Terms of service", "Contact")] + [
        text("Copyright 2026 Example Web. All rights reserved. Prices include sales tax.")]
