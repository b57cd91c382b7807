"""benchmarks/step_function_times.py: its timer wrapper and its list of timed functions."""

import collections
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_function_times.py"
sys.path.insert(0, str(SCRIPT.parent))  # it imports preset_step_profile from its folder
spec = importlib.util.spec_from_file_location("step_function_times", SCRIPT)
step_function_times = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_function_times)


def test_a_timed_function_returns_its_value_and_counts_every_call_even_one_that_raises():
    totals, calls = collections.Counter(), collections.Counter()

    def half(x):
        if x is None:
            raise ValueError
        return x / 2

    wrapped = step_function_times.timed(half, "half", totals, calls)
    assert wrapped(3) == 1.5
    with pytest.raises(ValueError):
        wrapped(None)
    assert calls["half"] == 2 and totals["half"] > 0


def test_every_timed_function_exists():
    """A renamed function fails here, not an hour into a run."""
    for owner, attribute in step_function_times.TIMED:
        assert callable(getattr(owner, attribute)), (owner, attribute)
