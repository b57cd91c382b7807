import torch

from confkv.budget import BudgetController
from confkv.policies import make_policy


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
