"""The task suite: >= 50 tasks; every expert trajectory passes its checker within the length targets."""

import re

import pytest

from confkv.eval.agent import WebEnv, build_tasks, make_world
from confkv.eval.agent.actions import Action
from confkv.eval.agent.expert import run_plan

WORLD = make_world(0)
TASKS = build_tasks(WORLD)
#: characters per SmolLM2 token on these pages (measured 2.31-3.42, median 2.73; the exact
#: counts are checked with the real tokenizer in tests/eval/agent/test_agent_tokens.py, integration)
CHARS_PER_TOKEN = 2.7


def _expert(task):
    env = WebEnv(WORLD, task.start_url, task.cart)
    return env, run_plan(env, task.plan)


def test_at_least_fifty_tasks_over_every_site():
    assert len(TASKS) >= 50 and len({t.tid for t in TASKS}) == len(TASKS)
    assert {t.start_url.split("/")[0] for t in TASKS} >= {"shop", "wiki", "mail"}
    plans = " ".join(str(t.plan) for t in TASKS)
    assert all(site in plans for site in ("'Forms'", "'Wiki'", "'Shop'", "'Compose'"))
    assert sum(t.info_early for t in TASKS) >= 20


def test_tasks_are_deterministic_in_the_seed():
    again = build_tasks(make_world(0))
    assert [(t.tid, t.goal, t.plan) for t in again] == [(t.tid, t.goal, t.plan) for t in TASKS]
    assert [t.goal for t in build_tasks(make_world(1))] != [t.goal for t in TASKS]


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.tid)
def test_expert_passes_its_checker_within_the_targets(task):
    env, steps = _expert(task)
    assert task.check(env.state), f"{task.tid}: the expert fails its own checker"
    assert 15 <= len(steps) <= 40
    pages = [len(s.observation) / CHARS_PER_TOKEN for s in steps]
    assert all(150 <= p <= 600 for p in pages)
    history = (len(task.goal) + sum(len(s.observation) + len(s.action.canonical()) for s in steps)) / CHARS_PER_TOKEN
    assert 3000 <= history <= 8000


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.tid)
def test_checker_rejects_doing_nothing_and_a_wrong_ending(task):
    env = WebEnv(WORLD, task.start_url, task.cart)
    assert not task.check(env.state)
    env.step(Action("stop", text="I do not know"))
    assert not task.check(env.state)


def test_checker_rejects_a_wrong_detail():
    task = next(t for t in TASKS if t.template == "promo_purchase")
    plan = [s if not (s[0] == "type" and s[2] == "Promo code") else (*s[:3], "SAVE-0000") for s in task.plan]
    env = WebEnv(WORLD, task.start_url, task.cart)
    run_plan(env, plan)
    assert env.state.orders and not task.check(env.state)
    task = next(t for t in TASKS if t.template == "wiki_earliest")
    env = WebEnv(WORLD, task.start_url, task.cart)
    run_plan(env, task.plan[:-1] + [("stop", f"{task.facts['city']}, 1000")])
    assert not task.check(env.state)


def test_information_seen_early_is_needed_late():
    """info_early tasks: a value typed late was first shown many steps before (the retrieval a cache must keep)."""
    gaps = []
    for task in (t for t in TASKS if t.info_early):
        _, steps = _expert(task)
        late = []
        for index, step in enumerate(steps):
            if step.action.kind in ("type", "stop") and step.action.text:
                for token in re.findall(r"[A-Z]{3}-[A-Z0-9]{4,6}|\d+\.\d\d|\d{1,2}:\d\d", step.action.text):
                    first = next(i for i, s in enumerate(steps) if token in s.observation)
                    assert first < index, f"{task.tid}: {token} is typed before it was ever shown"
                    late.append(index - first)
        gaps.append(max(late))
    assert min(gaps) >= 4 and sum(g >= 13 for g in gaps) >= 14
