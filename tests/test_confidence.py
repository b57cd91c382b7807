import math
import warnings
import pytest
import torch
from confkv import ConfidenceConfig, confidence
import sys


# every test on both codes: the native confidence terms (when built) and the torch code (conftest.py)
pytestmark = pytest.mark.usefixtures("native_and_torch_code")


def test_one_hot_is_confident():
    logits = torch.full((1, 1000), -1e4)
    logits[0, 3] = 1e4
    assert confidence(logits).item() > 0.99


def test_uniform_is_not_confident():
    assert confidence(torch.zeros(2, 1000)).max().item() < 0.01


def test_paper_sigmoid_form_has_its_floor():
    c = confidence(torch.zeros(1, 1000), ConfidenceConfig(margin_form="sigmoid"))
    assert c.item() == pytest.approx(0.3 * 0.5, abs=1e-3)


def test_monotonic_as_distribution_sharpens():
    base = torch.randn(1, 500, generator=torch.Generator().manual_seed(0))
    scales = [0.0, 0.5, 1, 2, 4, 8, 16, 32]
    values = [confidence(base * s).item() for s in scales]
    assert all(b >= a - 1e-6 for a, b in zip(values, values[1:])), values
    assert values[-1] - values[0] > 0.5


def test_per_sequence_and_weights():
    logits = torch.stack([torch.zeros(100), torch.nn.functional.one_hot(torch.tensor(1), 100).float() * 50])
    c = confidence(logits, ConfidenceConfig(w_entropy=1.0, w_margin=0.0, w_top=0.0))
    assert c[0].item() == pytest.approx(0.0, abs=1e-5) and c[1].item() == pytest.approx(1.0, abs=1e-4)


def test_nan_logits_are_low_confidence_with_warning():
    logits = torch.randn(3, 50)
    logits[1, 7] = math.nan
    with pytest.warns(RuntimeWarning, match="NaN logits"):
        c = confidence(logits)
    assert c[1].item() == 0.0 and torch.isfinite(c).all()


def test_inf_logits_do_not_crash():
    logits = torch.zeros(2, 10)
    logits[0, 2] = math.inf
    logits[1, :5] = -math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = confidence(logits)
    assert torch.isfinite(c).all() and c[0].item() > 0.99


def test_inf_logits_share_the_mass_equally():
    """k tokens at +inf among finite ones: uniform over those k, computed by hand."""
    vocab, k = 50, 3
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 5
    logits[0, [4, 9, 30]] = math.inf
    expected = 0.4 * (1 - math.log(k) / math.log(vocab)) + 0.3 * 0.0 + 0.3 / k  # margin log p1 - log p2 = 0
    assert confidence(logits).item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("kwargs, field", [
    ({"w_entropy": -0.1}, "w_entropy"),
    ({"w_entropy": 0.0, "w_margin": 0.0, "w_top": 0.0}, "all zero"),
    ({"w_top": math.nan}, "w_top"),
    ({"margin_form": "tanh"}, "margin_form"),
])
def test_bad_weights_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ConfidenceConfig(**kwargs)


# ---------------------------------------------------------------------------------------------------
# Confidence (:func:`confkv.confidence`) against the METHOD.md formula evaluated by hand in
# float64 with :mod:`math`, on small logit vectors, and its edge cases.
#
# Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).


# every test on both codes: the native confidence terms (when built) and the torch code (conftest.py)


def _by_hand(logits: list[float], w=(0.4, 0.3, 0.3), centered: bool = True) -> float:
    """c = (w_H (1 - H / log V) + w_m M(log p1 - log p2) + w_p p1) / (w_H + w_m + w_p), from scratch."""
    top = max(logits)
    z = sum(math.exp(x - top) for x in logits)
    p = sorted((math.exp(x - top) / z for x in logits), reverse=True)
    entropy = -sum(q * math.log(q) for q in p if q > 0)
    sig = 1 / (1 + math.exp(-(math.log(p[0]) - math.log(p[1]))))
    margin = 2 * sig - 1 if centered else sig
    w_h, w_m, w_p = w
    return (w_h * (1 - entropy / math.log(len(logits))) + w_m * margin + w_p * p[0]) / (w_h + w_m + w_p)


@pytest.mark.parametrize("row", [[2.0, 1.0, 0.0, -1.0], [0.3, 0.2, 0.25, 0.1, -0.4], [5.0, 4.9, -3.0]])
def test_default_confidence_equals_the_formula(row):
    assert confidence(torch.tensor([row])).item() == pytest.approx(_by_hand(row), abs=1e-6)


@pytest.mark.parametrize("weights", [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (2.0, 1.0, 1.0)])
def test_each_term_and_the_weight_normalisation(weights):
    row = [1.5, 0.5, 0.0, -2.0]
    config = ConfidenceConfig(w_entropy=weights[0], w_margin=weights[1], w_top=weights[2])
    assert confidence(torch.tensor([row]), config).item() == pytest.approx(_by_hand(row, weights), abs=1e-6)


def test_paper_sigmoid_margin_form():
    row = [1.0, 0.0, -0.5]
    config = ConfidenceConfig(margin_form="sigmoid")
    assert confidence(torch.tensor([row]), config).item() == pytest.approx(_by_hand(row, centered=False), abs=1e-6)


def test_rows_are_independent_and_the_output_is_float32():
    rows = [[2.0, 1.0, 0.0], [0.0, 0.0, 0.0], [9.0, -9.0, -9.0]]
    c = confidence(torch.tensor(rows, dtype=torch.float64))
    assert c.dtype == torch.float32 and c.shape == (3,)
    for value, row in zip(c.tolist(), rows):
        assert value == pytest.approx(_by_hand(row), abs=1e-6)


def test_plus_inf_logits_are_a_point_mass_shared_by_the_inf_tokens():
    logits = torch.tensor([[math.inf, 0.0, 3.0, -1.0],
                           [math.inf, math.inf, 0.0, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = confidence(logits)
    assert c[0].item() == pytest.approx(1.0, abs=1e-6)  # one-hot: H = 0, margin -> 1, p1 = 1
    # two +inf tokens: p = (1/2, 1/2, 0, 0): H = log 2, margin 0 (centered sigmoid 0), p1 = 1/2
    expected = 0.4 * (1 - math.log(2) / math.log(4)) + 0.3 * 0.0 + 0.3 * 0.5
    assert c[1].item() == pytest.approx(expected, abs=1e-6)


def test_minus_inf_logits_are_impossible_tokens():
    logits = torch.tensor([[1.0, 0.0, -math.inf, -math.inf]])
    p1 = math.e / (math.e + 1)
    entropy = -(p1 * math.log(p1) + (1 - p1) * math.log(1 - p1))
    margin = 2 / (1 + math.exp(-1.0)) - 1
    expected = 0.4 * (1 - entropy / math.log(4)) + 0.3 * margin + 0.3 * p1
    assert confidence(logits).item() == pytest.approx(expected, abs=1e-6)


def test_nan_rows_are_zero_and_other_rows_untouched():
    logits = torch.tensor([[2.0, 1.0, 0.0], [math.nan, 1.0, 0.0], [0.0, 0.0, 5.0]])
    with pytest.warns(RuntimeWarning, match=r"NaN logits in 1 sequence"):
        c = confidence(logits)
    assert c[1].item() == 0.0
    assert c[0].item() == pytest.approx(_by_hand([2.0, 1.0, 0.0]), abs=1e-6)
    assert c[2].item() == pytest.approx(_by_hand([0.0, 0.0, 5.0]), abs=1e-6)


def test_finite_rows_warn_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        confidence(torch.tensor([[1.0, 2.0]]))


def test_a_single_token_vocabulary_is_certain():
    assert confidence(torch.tensor([[0.3], [-7.0]])).tolist() == [1.0, 1.0]


def test_logits_must_be_two_dimensional():
    with pytest.raises(ValueError, match=r"logits must be \[batch, vocab\], got shape \(5,\)"):
        confidence(torch.zeros(5))


def test_nan_warning_points_at_the_callers_line():
    with pytest.warns(RuntimeWarning) as record:
        confidence(torch.tensor([[math.nan, 0.0]]))
    # stacklevel 2: the warning names the caller's line, not confkv's own code (mutmut's
    # trampoline adds a frame in between, so the exact caller is not asserted)
    assert record[0].filename != sys.modules["confkv.confidence"].__file__, record[0].filename
    instrumented = hasattr(sys.modules["confkv.confidence"], "x_confidence__mutmut_orig")
    if not instrumented:  # outside mutmut's instrumented copy: exactly this test's line
        assert record[0].filename == __file__, record[0].filename


@pytest.mark.parametrize("row", [[1.0, 0.0], [0.0, 0.0], [3.0, -2.0]])
def test_a_two_token_vocabulary_uses_the_formula(row):
    assert confidence(torch.tensor([row])).item() == pytest.approx(_by_hand(row), abs=1e-6)
