"""Scripted experts: a task's plan (high-level steps) resolved against the live pages into actions.

Plan steps (tuples):
    ("click", role, name)          click the node with this role and exact name
    ("type", role, name, text)     type ``text`` into that node
    ("see", substring)             make a node containing ``substring`` visible (scrolls; no action if shown)
    ("back",)                      go back
    ("stop", answer)               finish, with an answer ("" for none)
A target that is not on the current screen is reached by scrolling first, as a person would.
"""

from __future__ import annotations

from dataclasses import dataclass

from confkv.eval.agent import actions as A
from confkv.eval.agent.env import WebEnv


@dataclass
class ExpertStep:
    observation: str  # what the agent saw before acting
    action: A.Action


class PlanError(RuntimeError):
    """A plan step names a node that is not on the page (a bug in a task definition)."""


def _scroll_to(env: WebEnv, element_id: int, out: list[ExpertStep]) -> None:
    page = env.page()
    target = page.screen_of(element_id)
    for _ in range(len(page.spans()) + 1):
        if target is None or element_id in page.visible_ids(env.state.screen):
            return
        _act(env, A.scroll("down" if env.state.screen < target else "up"), out)
    raise PlanError(f"scrolling never showed element [{element_id}] on {page.url}")


def _act(env: WebEnv, action: A.Action, out: list[ExpertStep]) -> None:
    out.append(ExpertStep(env.observation(), action))
    result = env.step(action)
    if not result.ok:
        raise PlanError(f"expert action {action.canonical()} failed on {env.state.url}: {result.error}")


def _find(env: WebEnv, role: str, name: str) -> int:
    page = env.page()
    found = page.find(role, name)
    if found is None:
        raise PlanError(f"no {role} '{name}' on {page.url}")
    return found


def run_plan(env: WebEnv, plan: list[tuple]) -> list[ExpertStep]:
    """Execute ``plan`` on ``env``; returns each step's observation and the expert's action."""
    out: list[ExpertStep] = []
    for step in plan:
        kind = step[0]
        if kind in ("click", "type"):
            element = _find(env, step[1], step[2])
            _scroll_to(env, element, out)
            _act(env, A.click(element) if kind == "click" else A.type_text(element, step[3]), out)
        elif kind == "see":
            page = env.page()
            ids = [i + 1 for i, e in enumerate(page.elements()) if step[1] in e.name]
            if not ids:
                raise PlanError(f"no node containing {step[1]!r} on {page.url}")
            _scroll_to(env, ids[0], out)
        elif kind == "back":
            _act(env, A.go_back(), out)
        elif kind == "stop":
            _act(env, A.stop(step[1]), out)
        else:
            raise PlanError(f"unknown plan step {step!r}")
    return out
