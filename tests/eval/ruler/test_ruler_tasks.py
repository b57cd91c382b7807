"""RULER's synthetic tasks: deterministic, sized to the length, the answers really in the prompt; scoring."""

from __future__ import annotations

import re

import pytest

from confkv.errors import ConfigError
from confkv.eval.ruler.score import postprocess_pred, ruler_score, string_match_all, string_match_part
from confkv.eval.ruler.tasks import TASKS, make_ruler_sample
from confkv.models import tiny_tokenizer

# the byte tokenizer counts characters: the smallest length each task fits in
LENGTHS = {"vt": 2048, "cwe": 2048, "niah_multiquery": 1536}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("task", list(TASKS))
def test_same_arguments_give_the_same_sample(tok, task):
    length = LENGTHS.get(task, 1024)
    a = make_ruler_sample(task, tok, length, 3, seed=7)
    b = make_ruler_sample(task, tok, length, 3, seed=7)
    assert a.to_dict() == b.to_dict()
    other = make_ruler_sample(task, tok, length, 4, seed=7)
    assert (other.input, other.outputs) != (a.input, a.outputs)
    reseeded = make_ruler_sample(task, tok, length, 3, seed=8)
    assert (reseeded.input, reseeded.outputs) != (a.input, a.outputs)


@pytest.mark.parametrize("task", list(TASKS))
def test_sample_fits_the_length_and_holds_its_answers(tok, task):
    length = LENGTHS.get(task, 1024)
    s = make_ruler_sample(task, tok, length, 0)
    tokens = len(tok(s.prompt).input_ids)
    assert tokens == s.prompt_tokens
    assert tokens + s.max_new_tokens <= length
    assert tokens + s.max_new_tokens > 0.8 * length  # the haystack grew to (nearly) fill it
    assert s.outputs and len(set(s.outputs)) == len(s.outputs)
    body = s.input
    for answer in s.outputs:
        assert answer in body
    assert s.prompt.endswith(s.gen_prefix)


def test_niah_needles_state_the_answers(tok):
    s = make_ruler_sample("niah_multivalue", tok, 1024, 0)
    key = re.search(r"numbers for (\S+) mentioned", s.gen_prefix).group(1)
    for value in s.outputs:
        assert f"One of the special magic numbers for {key} is: {value}." in s.input


def test_vt_chain_leads_from_the_value_to_every_answer(tok):
    s = make_ruler_sample("vt", tok, 2048, 1)
    question = s.input[s.input.rindex("Question:"):]
    value = re.search(r"assigned the value (\d+)", question).group(1)
    body = s.input[s.input.rindex("Memorize"):]
    assigned = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)", body))
    reached, frontier = set(), {value}
    while frontier:
        new = {v for v, rhs in assigned.items() if rhs in frontier or rhs.replace("VAR ", "") in frontier}
        new -= reached
        reached |= new
        frontier = new
    assert reached == set(s.outputs)


def test_cwe_answers_are_the_most_common_words(tok):
    s = make_ruler_sample("cwe", tok, 2048, 2)
    listing = s.input[s.input.rindex("Below is"):]
    words = re.findall(r"\d+\. (\w+)", listing)
    counts = {w: words.count(w) for w in set(words)}
    top = sorted(counts, key=lambda w: -counts[w])[:10]
    assert set(top) == set(s.outputs)


def test_fwe_answers_are_the_most_frequent_coded_words(tok):
    s = make_ruler_sample("fwe", tok, 1024, 0)
    text = s.input[: s.input.rindex("Question:")]
    words = [w for w in re.findall(r"\b[a-z]{6}\b", text)]
    counts = {w: words.count(w) for w in set(words)}
    ranked = sorted(counts, key=lambda w: -counts[w])
    assert set(ranked[:3]) == set(s.outputs)


def test_unknown_task_and_short_length_are_refused(tok):
    with pytest.raises(ConfigError, match="qa_squad"):
        make_ruler_sample("qa_squad", tok, 4096, 0)
    with pytest.raises(ConfigError, match="longer length"):
        make_ruler_sample("niah_single_1", tok, 300, 0)


def test_string_match_all_and_part():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("The numbers are 123.", ["123", "456"]) == 0.5
    assert string_match_all("  ABC-def\x00", ["abc-DEF"]) == 1.0
    assert string_match_part("only 456", ["123", "456"]) == 1.0
    assert string_match_part("none", ["123", "456"]) == 0.0
    assert ruler_score("x 1 y", ["1"], "all") == 1.0
    assert postprocess_pred("  a\tb  ") == "a\nb"
    with pytest.raises(ValueError, match="metric"):
        ruler_score("x", ["x"], "exact")
