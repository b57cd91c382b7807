"""The wiki: home (article index), search, article pages with sections and "See also" links."""

from __future__ import annotations

from confkv.eval.agent.page import Element, Page
from confkv.eval.agent.sites.common import heading, link, nav, sentences, text
from confkv.eval.agent.state import BrowserState
from confkv.eval.agent.world import World


def _header() -> list[Element]:
    return nav([Element("searchbox", "Search wiki", target="search:wiki", depth=1)])


def build(world: World, state: BrowserState, path: str) -> Page | None:
    """Page for ``wiki/<path>`` or None when there is no such page."""
    if path == "":
        body = [heading("Wiki - Main page"), text("Articles by topic:")]
        for kind, label in (("city", "Cities"), ("building", "Buildings"), ("project", "Projects")):
            body.append(heading(label))
            body += [link(a.title, f"wiki/article/{a.slug}") for a in world.articles_of(kind)]
        return Page("wiki/", "Wiki - Main page", _header(), body)
    if path.startswith("search?q="):
        query = path.split("=", 1)[1]
        words = query.lower().split()
        found = [a for a in world.articles if words and all(w in (a.title + " " + a.summary).lower() for w in words)]
        body = [heading(f"Search results for '{query}'"), text(f"{len(found)} articles")]
        for a in found:
            body += [link(a.title, f"wiki/article/{a.slug}"), text(a.summary, depth=3)]
        return Page(f"wiki/{path}", "Wiki - Search", _header(), body)
    if path.startswith("article/"):
        slug = path.split("/", 1)[1]
        try:
            article = world.article(slug)
        except StopIteration:
            return None
        body = [heading(article.title), text(article.summary)]
        for title, paragraphs in article.sections:
            body.append(heading(title))
            for paragraph in paragraphs:
                body += [text(s) for s in sentences(paragraph)]
        body.append(heading("See also"))
        body += [link(a.title, f"wiki/article/{a.slug}") for a in world.articles_of(article.kind) if a is not article][:4]
        return Page(f"wiki/{path}", f"Wiki - {article.title}", _header(), body)
    return None
