import torch
from confkv.budget import BudgetController
from confkv.policies import make_policy
import pytest


def test_gate_picks_tight_budget_when_confident_per_sequence():
    controller = BudgetController(make_policy("confkv", n_high=64, n_low=128, tau=0.6), num_layers=3)
    budgets = controller.step(torch.tensor([0.6, 0.59, 1.0, 0.0]))
    assert budgets.shape == (4, 3)
    assert budgets[:, 0].tolist() == [64, 128, 64, 128]


def test_smoothed_gate_follows_the_moving_average():
    controller = BudgetController(make_policy("confkv", n_high=64, n_low=128, tau=0.5, smoothing=0.5), 1)
    seen = [int(controller.step(torch.tensor([c]))[0, 0]) for c in [1.0, 0.0, 0.0, 1.0, 1.0]]
    # gated: 1.0, 0.5, 0.25, 0.625, 0.8125
    assert seen == [64, 64, 128, 64, 64]


def test_batch_selection_keeps_the_right_state():
    controller = BudgetController(make_policy("confkv", n_high=64, n_low=128, tau=0.5, smoothing=0.9), 1)
    controller.step(torch.tensor([1.0, 0.0]))
    controller.select_batch(torch.tensor([1]))
    assert controller.step(torch.tensor([1.0]))[0, 0].item() == 128  # 0.9 * 0 + 0.1 * 1 < tau


# ---------------------------------------------------------------------------------------------------
# The budget controller (:mod:`confkv.budget`) with and without a confidence gate, by hand.
#
# Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).


def test_a_policy_without_gate_has_no_smoothing_and_a_constant_budget():
    controller = BudgetController(make_policy("window", budget=40), num_layers=2)
    assert controller.smoothing == 0.0 and controller.gated is None
    assert controller.step(torch.tensor([0.9, 0.1])).tolist() == [[40, 40], [40, 40]]
    controller.step(torch.tensor([0.2, 0.7]))
    assert controller.gated.tolist() == pytest.approx([0.2, 0.7])  # the raw confidence, unsmoothed


def test_smoothing_is_the_gates_and_restarts_when_the_batch_changes():
    controller = BudgetController(make_policy("confkv", n_high=64, n_low=128, tau=0.5, smoothing=0.75), 1)
    assert controller.smoothing == 0.75
    controller.step(torch.tensor([1.0, 0.0]))
    controller.step(torch.tensor([0.0, 1.0]))
    assert controller.gated.tolist() == pytest.approx([0.75, 0.25])  # 0.75 * old + 0.25 * new
    controller.step(torch.tensor([0.3]))  # a different batch size: the state starts again
    assert controller.gated.tolist() == pytest.approx([0.3])
    assert controller.step(torch.tensor([0.9])).tolist() == [[128]]  # 0.75 * 0.3 + 0.25 * 0.9 = 0.45 < tau
