"""The README fits a screen's worth of reading, and every relative link of the README and of
``docs/*.md`` (and of ``results/INDEX.md``) resolves in a clone (issue 33).

A link is Markdown's ``[text](target)`` or ``![alt](target)``; a target with a scheme
(``https:``, ``mailto:``) or only an anchor (``#part``) is not checked. A target is resolved from
the folder of the page that holds it and must exist in the repository; its ``#anchor``, when it
points at a Markdown page, must be one of that page's headings (GitHub's slugs).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT = 12 * 1024
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "INDEX.md"]


def links(text: str) -> list[str]:
    """The link targets of a Markdown text, code blocks and inline code left out."""
    text = FENCE.sub("", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(match) for match in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE)}


def broken(page: Path) -> list[str]:
    found = []
    for target in links(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve()
        if not resolved.exists() or ROOT not in resolved.parents:
            found.append(f"{target} (no such file in the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            found.append(f"{target} (no heading '#{anchor}' in {resolved.relative_to(ROOT)})")
    return found


def test_the_readme_is_at_most_12_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; at most {README_LIMIT}: move detail into docs/"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert page.exists(), f"{page.relative_to(ROOT)} is missing"
    assert not broken(page), f"broken links in {page.relative_to(ROOT)}: {broken(page)}"


def test_the_checker_sees_a_broken_link_and_a_bad_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Top part\n[ok](b.md#the-end) [gone](nope.md) [bad](b.md#missing) "
                                   "[web](https://x.org) `[code](nope.md)`\n```\n[fenced](nope.md)\n```\n")
    (tmp_path / "b.md").write_text("## The end\n")
    assert broken(tmp_path / "a.md") == ["nope.md (no such file in the repository)",
                                         "b.md#missing (no heading '#missing' in b.md)"]
