"""The text web environment: a browser over the seeded sites, driven by :class:`Action` s.

``env.observation()`` is the current page as a numbered accessibility tree;
``env.step(action)`` applies one action and returns a :class:`StepResult`. An action that
cannot be applied (unparsed output, an id that is not on the screen, typing into a
link, ...) is a *failed step*: the state is unchanged apart from a notice naming the
problem, and ``StepResult.ok`` is False. Nothing here raises on agent input.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

from confkv.eval.agent.actions import Action
from confkv.eval.agent.page import Element, Page
from confkv.eval.agent.sites import forms, mail, shop, wiki
from confkv.eval.agent.sites.common import footer
from confkv.eval.agent.state import BrowserState
from confkv.eval.agent.world import World, make_world

_SITES = {"shop": shop.build, "wiki": wiki.build, "mail": mail.build, "forms": forms.build}


@dataclass(frozen=True)
class StepResult:
    ok: bool
    error: str = ""
    done: bool = False


class WebEnv:
    """One browser session over the sites of ``world`` (a :class:`World` or a seed)."""

    def __init__(self, world: World | int = 0, start_url: str = "shop/", cart: dict[str, int] | None = None) -> None:
        self.world = world if isinstance(world, World) else make_world(world)
        self.state = BrowserState(url=start_url, cart=dict(cart or {}))
        if self.page() is None:
            raise ValueError(f"start_url {start_url!r} is not a page; use e.g. 'shop/', 'wiki/', 'mail/', 'forms/'")

    # -- pages -------------------------------------------------------------------------------------
    def page(self, url: str | None = None) -> Page | None:
        url = self.state.url if url is None else url
        site, _, path = url.partition("/")
        builder = _SITES.get(site)
        page = builder(self.world, self.state, unquote(path)) if builder else None
        if page is not None:
            page.body += footer()
        return page

    def observation(self) -> str:
        """The current screen as text; a pending notice (last step's result) is shown first."""
        page = self.page()
        assert page is not None
        text = page.render(self.state.screen)
        if self.state.notice:
            text = f"NOTICE: {self.state.notice}\n" + text
        return text

    def visible_element(self, element_id: int | None) -> Element | None:
        page = self.page()
        if page is None or element_id is None or element_id not in page.visible_ids(self.state.screen):
            return None
        return page.elements()[element_id - 1]

    # -- actions -----------------------------------------------------------------------------------
    def step(self, action: Action) -> StepResult:
        """Apply ``action``; failed steps leave the state unchanged (apart from the notice)."""
        state = self.state
        state.notice = ""
        if state.done:
            return StepResult(False, "the episode is over", True)
        if not action.valid:
            return self._fail("could not read an action; write e.g. click [12]")
        if action.kind == "stop":
            state.answer, state.done = action.text, True
            return StepResult(True, done=True)
        if action.kind == "back":
            if not state.history:
                return self._fail("there is no previous page")
            state.url, state.screen = state.history.pop()
            return StepResult(True)
        if action.kind == "scroll":
            page = self.page()
            last = len(page.screens()) - 1
            target = state.screen + (1 if action.text == "down" else -1)
            if not 0 <= target <= last:
                return self._fail(f"cannot scroll {action.text} any further")
            state.screen = target
            return StepResult(True)
        element = self.visible_element(action.element)
        if element is None:
            return self._fail(f"there is no element [{action.element}] on the screen")
        if action.kind == "type":
            return self._type(element, action.text)
        return self._click(element)

    def _fail(self, why: str) -> StepResult:
        self.state.notice = f"Action failed: {why}."
        return StepResult(False, why)

    def _go(self, url: str) -> StepResult:
        if url != self.state.url or self.state.screen:
            self.state.history.append((self.state.url, self.state.screen))
        self.state.url, self.state.screen = url, 0
        return StepResult(True)

    def _type(self, element: Element, text: str) -> StepResult:
        kind, _, key = element.target.partition(":")
        if element.role not in ("textbox", "searchbox"):
            return self._fail(f"cannot type into a {element.role}")
        if kind == "search":
            return self._go(f"{key}/search?q={quote(text.strip())}")
        self.state.fields[key] = text
        return StepResult(True)

    def _click(self, element: Element) -> StepResult:
        kind, _, rest = element.target.partition(":")
        state = self.state
        if kind == "url":
            return self._go(rest)
        if kind == "radio":
            group, _, value = rest.rpartition(":")
            state.fields[group] = value
            return StepResult(True)
        if kind == "check":
            state.fields[rest] = "" if state.fields.get(rest) == "on" else "on"
            return StepResult(True)
        if kind == "cmd":
            return self._command(rest)
        return self._fail(f"clicking the {element.role} '{element.name}' does nothing")

    def _command(self, command: str) -> StepResult:
        state, world = self.state, self.world
        name, _, arg = command.partition(":")
        if name == "url":
            return self._go(arg)
        if name == "add":
            raw = state.fields.get(f"product:{arg}.qty", "1").strip() or "1"
            if not raw.isdigit() or int(raw) < 1:
                return self._fail(f"quantity must be a whole number of at least 1, got '{raw}'")
            state.cart[arg] = state.cart.get(arg, 0) + int(raw)
            state.notice = f"Added {raw} x {world.product(arg).name} to the cart."
            return StepResult(True)
        if name == "remove":
            state.cart.pop(arg, None)
            return StepResult(True)
        if name == "order":
            return self._go_or_stay(shop.place_order(world, state))
        if name == "send":
            return self._go_or_stay(mail.send(state))
        if name == "submit":
            return self._go(forms.submit(world, state, arg))
        return self._fail(f"unknown command {command!r}")

    def _go_or_stay(self, url: str) -> StepResult:
        if url == self.state.url:
            return StepResult(False, self.state.notice)
        return self._go(url)
