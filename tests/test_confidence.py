import math
import warnings

import pytest
import torch

from confkv import ConfidenceConfig, confidence

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
