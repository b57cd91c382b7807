"""docs/ARCHITECTURE.md lists the files one decode step enters; the list must be the real step's."""

import re
from pathlib import Path

from confkv.eval.bench.step_trace import files_of_one_decode_step

DOC = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"


def _listed_files() -> list[str]:
    text = DOC.read_text()
    block = text.split("<!-- step-files", 1)[1].split("<!-- /step-files -->", 1)[0]
    return re.findall(r"^\d+\. `confkv/([^`]+)`", block, flags=re.MULTILINE)


def test_the_hand_trace_lists_the_files_the_step_enters_in_order():
    entered = [name for name, _ in files_of_one_decode_step()]
    assert _listed_files() == entered, "update docs/ARCHITECTURE.md from `python -m confkv.eval.bench.step_trace`"


def test_the_doc_states_the_count_it_lists():
    count = len(_listed_files())
    assert f"It enters {count}." in DOC.read_text()


def test_the_step_enters_at_most_a_dozen_files():
    """Issue 33's bar: one decode step of the memory preset enters at most 12 Python files of the package."""
    entered = [name for name, _ in files_of_one_decode_step()]
    assert len(entered) <= 12, f"the step enters {len(entered)} files: {entered}"


def test_the_candidate_default_s_int8_open_page_adds_no_file_to_the_step():
    """The INT8 open page (``open_bits=8``) is the candidate for the default (results/memory/README.md, "INT8 rows in
    one C call"): its codec and the C call it makes live in files the step enters already, so a switch keeps the
    dozen."""
    entered = [name for name, _ in files_of_one_decode_step(open_bits=8)]
    assert len(entered) <= 12, f"the step enters {len(entered)} files: {entered}"
