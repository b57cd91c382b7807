"""Degradation guard: CONF-KV's streaming perplexity on a fixed 512-token text vs a recorded reference.

``results/reference/guard.json`` holds, per case, the token ids, the configuration and the
recorded perplexities (and the exact command that recorded them:
``python -m confkv.eval.quality.guard``). A refactor that changes quality fails here, loudly. If the
change is intended, re-record with the command in the file and say so in the commit.

The tiny cases (default suite) use a tiny random Llama: a deterministic fingerprint with a
tight tolerance (1e-4 relative). The SmolLM2 case (``-m integration``) is the 1% check on
the real model.
"""

import json
from pathlib import Path

import pytest
import torch

from confkv.eval.quality.guard import CASES, compare, load_case_model, run_case

REFERENCE = Path(__file__).resolve().parents[3] / "results" / "reference" / "guard.json"


def _recorded(name):
    data = json.loads(REFERENCE.read_text())
    if name not in data["cases"]:
        pytest.fail(f"no recorded guard case {name!r} in {REFERENCE}; record it: {data['regenerate']}")
    return data["cases"][name]


def _check(name):
    recorded = _recorded(name)
    case = CASES[name]
    assert recorded["params"] == case.params and recorded["store"] == case.store, (
        f"case {name!r} changed since it was recorded; re-record: {recorded['command']}")
    model, _ = load_case_model(case)
    ids = torch.tensor([[int(x) for x in recorded["ids"].split()]])
    measured = run_case(case, model, ids)
    problems = compare(recorded, measured, case.rel_tol)
    assert not problems, (f"DEGRADATION GUARD ({name}): " + "; ".join(problems)
                          + f". If intended, re-record with: {recorded['command']}")
    # the memory side is determined by the budgets alone: exact
    assert measured["peak_kv_bytes"] == recorded["peak_kv_bytes"], (measured["peak_kv_bytes"], recorded["peak_kv_bytes"])
    return measured


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["tiny-fp", "tiny-int8"])
def test_tiny_guard(name):
    _check(name)


def test_guard_catches_a_changed_eviction(monkeypatch):
    """Sanity of the guard itself: ranking the slots backwards moves the PPL far outside the tolerance."""
    from confkv.policies.confkv import ConfKVPolicy

    original = ConfKVPolicy.scores
    monkeypatch.setattr(ConfKVPolicy, "scores", lambda self, *a: -original(self, *a))
    recorded = _recorded("tiny-fp")
    model, _ = load_case_model(CASES["tiny-fp"])
    ids = torch.tensor([[int(x) for x in recorded["ids"].split()]])
    measured = run_case(CASES["tiny-fp"], model, ids)
    assert compare(recorded, measured, CASES["tiny-fp"].rel_tol), measured


@pytest.mark.integration
def test_smollm2_guard():
    _check("smollm2")
