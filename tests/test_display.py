"""The "never evict" budget sentinel (UNLIMITED = 2**62) reads "unlimited" wherever a person sees it."""

import json

import torch

from confkv.display import budget_from_json, budget_text, budget_to_json, budgets_text, is_unlimited
from confkv.eval.report.plots import trace_from_dict
from confkv.policies import UNLIMITED
from confkv.tiers.planner import MemoryTrace, StepRecord


def trace_with_budgets(budgets: list[int]) -> MemoryTrace:
    """A one-sequence trace whose kept tokens grow by one per step, with the given budgets."""
    trace = MemoryTrace()
    for step, budget in enumerate(budgets):
        trace.record(StepRecord(confidence=torch.tensor([0.5]), budget=torch.tensor([budget]),
                                kept=torch.tensor([[step + 1]]), kv_bytes=torch.tensor([64 * (step + 1)]), seen=step + 1))
    return trace


def test_texts():
    assert budget_text(UNLIMITED) == "unlimited" and budget_text(512) == "512"
    assert budgets_text([UNLIMITED, UNLIMITED]) == "[unlimited]"
    assert budgets_text([256.0, 128.0, 256.0]) == "[128, 256]"
    assert budgets_text([UNLIMITED, 64]) == "[64, unlimited]"
    assert budgets_text(list(range(10))) == "[0, 1, 2, 3, 4, 5] ..."
    assert not is_unlimited(UNLIMITED - 1) and is_unlimited("unlimited")


def test_trace_json_says_unlimited_and_reads_back():
    trace = trace_with_budgets([UNLIMITED, UNLIMITED, 128])
    text = json.dumps(trace.to_dict())
    assert str(UNLIMITED) not in text
    assert trace.to_dict()["budget"] == [["unlimited"], ["unlimited"], [128]]
    again = trace_from_dict(json.loads(text))
    assert [int(s.budget[0]) for s in again.steps] == [UNLIMITED, UNLIMITED, 128]
    assert budget_from_json(budget_to_json([[UNLIMITED, 3]])) == [[UNLIMITED, 3]]

