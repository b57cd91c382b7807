"""benchmarks/bench_paired_ratios.py: a row's steps over the baseline's, round by round.

Seen failing with bugs put in by hand (then removed): each round divided by the baseline's first round; the
rounds cut one step off (``steps - 1``); the pooled median a mean."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_paired_ratios.py"
spec = importlib.util.spec_from_file_location("bench_paired_ratios", SCRIPT)
paired = importlib.util.module_from_spec(spec)
spec.loader.exec_module(paired)


def test_each_round_is_divided_by_the_baseline_in_the_same_round():
    # the machine slows down 2x in the second round: the row is 1.1x the baseline in both rounds
    baseline = [10.0, 12.0, 20.0, 24.0]
    row = [11.0, 13.2, 22.0, 26.4]
    assert paired.paired_ratios(row, baseline, steps=2) == pytest.approx([1.1, 1.1])
    # a row slower only in its first step of a round: the round's mean, not its first step
    assert paired.paired_ratios([15.0, 11.0, 20.0, 24.0], baseline, steps=2) == pytest.approx([26 / 22, 1.0])


def test_rows_of_other_lengths_or_partial_rounds_are_refused():
    with pytest.raises(ValueError, match="not the same whole rounds of 2"):
        paired.paired_ratios([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], steps=2)
    with pytest.raises(ValueError, match="hold 4 and 2 steps"):
        paired.paired_ratios([1.0] * 4, [1.0] * 2, steps=2)


def test_the_pooled_median_is_over_every_round_of_every_run():
    # two runs of one row, 3 rounds at 1.0 then 1 round at 2.0: their median 1.0 (their mean 1.25)
    rounds = {("8192", "row"): [1.0, 1.0, 1.0] + [2.0], ("8192", "other"): [1.2, 1.4]}
    assert paired.pooled_median(rounds) == {("8192", "row"): (1.0, 4), ("8192", "other"): (pytest.approx(1.3), 2)}
