"""The mutable state of one episode: where the browser is, what it has typed, bought and sent."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BrowserState:
    """Everything an action can change. The checkers read ``cart``, ``orders``, ``sent``, ``submitted``.

    url: the current page ("shop/product/SKU-12345"); screen: the scrolled screen of it;
    history: (url, screen) pairs for ``go back``; fields: typed text / radio choice /
    checkbox state keyed by "<form>.<field>"; notice: one line shown on the next page.
    """

    url: str
    screen: int = 0
    history: list[tuple[str, int]] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)
    cart: dict[str, int] = field(default_factory=dict)  # sku -> quantity
    orders: list[dict[str, Any]] = field(default_factory=list)
    sent: list[dict[str, str]] = field(default_factory=list)
    submitted: list[dict[str, Any]] = field(default_factory=list)
    notice: str = ""
    answer: str | None = None  # set by ``stop``
    done: bool = False

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy (for records and tests)."""
        return copy.deepcopy({k: v for k, v in self.__dict__.items()})
