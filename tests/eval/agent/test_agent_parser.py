"""The tolerant action parser: formatting noise is read, garbage is a failed step, nothing raises."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from confkv.eval.agent.actions import Action, format_action, parse_action


@pytest.mark.parametrize("raw, expected", [
    ("click [12]", "click [12]"),
    ("```click [1234]```", "click [1234]"),
    ("`click [7]`", "click [7]"),
    ("CLICK 12", "click [12]"),
    ("Click on [3].", "click [3]"),
    ("In summary, the next action I will perform is ```type [5] [hello world] [1]```", 'type [5] "hello world"'),
    ('Let me search. type [13] "gaming laptop" then press enter', 'type [13] "gaming laptop"'),
    ("type [3] laptop", 'type [3] "laptop"'),
    ("type 3 'laptop'", 'type [3] "laptop"'),
    ("scroll down", "scroll down"),
    ("Scroll [DOWN]", "scroll down"),
    ("scroll up please", "scroll up"),
    ("go back", "go back"),
    ("Go_Back", "go back"),
    ('stop ["$12.99"]', 'stop ["$12.99"]'),
    ("stop [Arden, 1204]", 'stop ["Arden, 1204"]'),
    ("stop", "stop"),
    ("```\nclick [4]\n```\nbecause it is the cart", "click [4]"),
    ("I think I should click [9] and then scroll down", "click [9]"),
])
def test_noisy_actions_are_read(raw, expected):
    assert parse_action(raw).canonical() == expected


@pytest.mark.parametrize("raw", ["", "   ", "hello", "click", "click [abc]", "type", "scroll sideways", "[12]",
                                 "\x00\x01", None, 12])
def test_unreadable_output_is_an_invalid_action(raw):
    action = parse_action(raw)
    assert action.kind == "invalid" and not action.valid


@given(st.text(max_size=80))
@settings(max_examples=200, deadline=None)
def test_parser_never_raises(text):
    action = parse_action(text)
    assert isinstance(action, Action)


@pytest.mark.parametrize("action", [Action("click", 3), Action("type", 4, "a b"), Action("scroll", text="up"),
                                    Action("back"), Action("stop", text="x y"), Action("stop")])
def test_format_then_parse_round_trips(action):
    assert parse_action(format_action(action)).canonical() == action.canonical()


def test_bad_action_kind_names_the_field():
    with pytest.raises(ValueError, match="Action.kind"):
        Action("jump")
