"""The text web environment: determinism, pages, failed steps as values."""

import pickle

import pytest

from confkv.eval.agent import WebEnv, make_world, parse_action
from confkv.eval.agent.actions import Action
from confkv.eval.agent.page import Element, Page

SCRIPT = ["click [12]", "scroll down", "click [14]", "type [5] \"nimbus\"", "go back", "click [3]", "scroll down",
          "click [13]", "click [2]", "type [5] \"arden\""]


def _observations(seed):
    env = WebEnv(seed, "shop/")
    out = [env.observation()]
    for line in SCRIPT:
        env.step(parse_action(line))
        out.append(env.observation())
    return out, env.state.snapshot()


def test_same_seed_same_pages_and_state():
    assert _observations(3) == _observations(3)
    assert pickle.dumps(make_world(5)) == pickle.dumps(make_world(5))


def test_other_seed_other_world():
    assert _observations(3)[0] != _observations(4)[0]
    assert make_world(1).products != make_world(2).products


def test_pages_are_numbered_accessibility_trees():
    env = WebEnv(0, "shop/")
    text = env.observation()
    assert text.splitlines()[0].startswith("[0] RootWebArea 'Shop - Home'")
    assert "[1] link 'Shop'" in text and "[5] searchbox 'Search products'" in text


@pytest.mark.parametrize("line, why", [
    ("click [999]", "no element [999]"),
    ("gibberish", "could not read an action"),
    ("go back", "no previous page"),
    ("scroll up", "cannot scroll up"),
    ("type [1] \"x\"", "cannot type into a link"),
    ("click [8]", "does nothing"),  # a heading
])
def test_failed_steps_are_values_and_change_nothing(line, why):
    env = WebEnv(0, "shop/")
    before = env.state.snapshot()
    result = env.step(parse_action(line))
    assert not result.ok and why in result.error
    after = env.state.snapshot()
    assert after.pop("notice") and before.pop("notice") == ""
    assert after == before
    assert "Action failed" in env.observation()


def test_hidden_elements_cannot_be_clicked_until_scrolled_to():
    env = WebEnv(0, "mail/")
    page = env.page()
    hidden = max(page.visible_ids(0)) + 1
    assert not env.step(Action("click", element=hidden)).ok
    env.step(parse_action("scroll down"))
    assert hidden in page.visible_ids(env.state.screen)


def test_last_screen_is_full_and_screens_cover_the_body():
    body = [Element("StaticText", f"line {i} " + "x" * 40) for i in range(30)]
    page = Page("t/", "T", [], body)
    spans = page.spans()
    covered = set()
    for begin, end in spans:
        covered |= set(range(begin, end))
    assert covered == set(range(30)) and len(spans) > 2
    assert spans[-1][1] - spans[-1][0] >= spans[0][1] - spans[0][0] - 1


def test_checkout_needs_the_address_and_records_the_order():
    env = WebEnv(0, "shop/checkout", cart={make_world(0).products[0].sku: 1})
    page = env.page()
    env.state.screen = len(page.spans()) - 1
    assert not env.step(Action("click", element=page.find("button", "Place order"))).ok  # no address yet
    assert "Please fill in" in env.observation() and not env.state.orders
    env.state.fields.update({"checkout.name": "A B", "checkout.street": "1 Oak", "checkout.city": "Arden",
                             "checkout.zip": "12345", "checkout.shipping": "Store pickup"})
    env.state.screen = len(page.spans()) - 1
    env.step(Action("click", element=page.find("button", "Place order")))
    assert env.state.orders and env.state.orders[0]["city"] == "Arden" and env.state.cart == {}


def test_agent_modules_do_not_import_transformers():
    import subprocess
    import sys

    code = ("import sys, confkv.eval.agent, confkv.eval.agent.expert, confkv.eval.agent.prompt\n"
            "print('transformers' in sys.modules)\n"
            "import confkv.eval.agent.grid, confkv.eval.agent.harness\nprint('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
