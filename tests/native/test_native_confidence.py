"""The native confidence terms (kernels.c ``confkv_confidence_terms``) against the torch code of
:func:`confkv.confidence.confidence`."""
import math

import pytest
import torch

from confkv import native
from confkv.confidence import confidence
from confkv.config import ConfidenceConfig
from confkv.native import loader

pytestmark = [pytest.mark.skipif(not native.available(), reason="native kernels unavailable"),
              pytest.mark.usefixtures("nan_filled_empty")]  # buffers to be overwritten start as NaN


def _torch_confidence(logits, config=None):
    with loader.disabled():
        return confidence(logits, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 2, 17, 1000, 49152])
@pytest.mark.parametrize("scale", [0.1, 3.0, 40.0])  # flat to sharp distributions
def test_native_confidence_matches_torch(dtype, vocab, scale):
    logits = (torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab)) * scale).to(dtype)
    terms = native.confidence_terms(logits)
    assert terms is not None and terms.shape == (3, 3)
    for config in (ConfidenceConfig(), ConfidenceConfig(w_entropy=1.0, w_margin=0.0, w_top=0.0),
                   ConfidenceConfig(w_entropy=0.0, w_margin=1.0, w_top=0.0, margin_form="sigmoid")):
        torch.testing.assert_close(confidence(logits, config), _torch_confidence(logits, config), rtol=2e-5, atol=2e-6)


def test_native_terms_are_entropy_and_top_two_log_probs():
    logits = torch.tensor([[2.0, 1.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    log_probs = torch.log_softmax(logits, -1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    top2 = log_probs.topk(2, -1).values
    expected = torch.stack([entropy, top2[:, 0], top2[:, 1]], -1)
    torch.testing.assert_close(native.confidence_terms(logits), expected, rtol=1e-6, atol=1e-6)
    assert native.confidence_terms(logits)[1, 0].item() == pytest.approx(math.log(4), rel=1e-6)


def test_a_one_token_vocabulary_gives_log_p2_equal_to_log_p1():
    """The kernel's stated contract for V = 1 (no second token): entropy 0 and log p1 = log p2 = 0, not -inf."""
    logits = torch.tensor([[3.5], [-2.0]])
    terms = native.confidence_terms(logits)
    assert terms is not None
    assert torch.equal(terms, torch.zeros(2, 3)), terms


def test_non_finite_rows_take_the_torch_code():
    logits = torch.randn(2, 50)
    logits[1, 3] = float("nan")
    assert native.confidence_terms(logits) is None
    with pytest.warns(RuntimeWarning, match="NaN logits"):
        c = confidence(logits)
    assert c[1].item() == 0.0 and 0.0 < c[0].item() <= 1.0
    logits = torch.randn(1, 50)
    logits[0, 7] = float("inf")
    assert native.confidence_terms(logits) is None
    assert confidence(logits).item() == pytest.approx(1.0)
    logits[0, 7] = -float("inf")
    assert native.confidence_terms(logits) is None
    torch.testing.assert_close(confidence(logits), _torch_confidence(logits))


def test_strided_rows_and_other_dtypes():
    wide = torch.randn(2, 300)
    view = wide[:, :120]  # rows 300 elements apart
    torch.testing.assert_close(confidence(view), _torch_confidence(view.contiguous()), rtol=2e-5, atol=2e-6)
    assert native.confidence_terms(wide.half()) is None  # float16: the torch code
