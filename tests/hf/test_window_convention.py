"""The budget convention (docs/USAGE.md, "What a budget counts"), checked on tiny models.

A budget of N is what a layer holds at the end of each step, so under ``window`` the
token at position i is predicted from positions ``i - N .. i`` (``0 <= i - j <= N``), and
under ``streaming`` with S sinks from ``0 <= i - j <= N - S`` or ``j < S``. The reference
here is one forward pass of a fresh copy of the model with that banded mask, built in this
file from the statement alone (not from the cache, nor from the benchmark's helper). The
streaming loop must agree to float noise: a window one token off is far outside it.
"""

import math

import pytest
import torch

from confkv.eval.quality.ppl import streaming_ppl
from confkv.hf.support import kv_shape
from confkv.tiers.byte_model import full_cache_bytes
from confkv.models import tiny_model

TOKENS = 48


def _mask_from_statement(n: int, budget: int, sinks: int) -> torch.Tensor:
    """[1, 1, n, n] additive mask: query i sees key j iff 0 <= i - j <= budget - sinks, or j < sinks (j <= i)."""
    visible = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(i + 1):
            visible[i, j] = (i - j <= budget - sinks) or j < sinks
    return torch.zeros(n, n).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]


def _banded_nll(model, ids: torch.Tensor, budget: int, sinks: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids, attention_mask=_mask_from_statement(ids.shape[1], budget, sinks)).logits[0].double()
    return torch.logsumexp(logits[:-1], -1) - logits[:-1].gather(1, ids[0, 1:, None])[:, 0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("policy, budget, sinks", [("window", 9, 0), ("streaming", 9, 2), ("window", 16, 0)])
def test_streaming_loop_equals_the_stated_band(arch, policy, budget, sinks):
    ids = torch.randint(0, 250, (1, TOKENS), generator=torch.Generator().manual_seed(11))
    reference = _banded_nll(tiny_model(arch, seed=3), ids, budget, sinks)
    params = {"budget": budget} if policy == "window" else {"budget": budget, "sinks": sinks}
    result = streaming_ppl(tiny_model(arch, seed=3), ids, policy, progress=False, **params)
    torch.testing.assert_close(result.nll, reference, atol=2e-5, rtol=0)
    # one token more or less of context is far outside that tolerance (so the check can fail)
    for other in (budget - 1, budget + 1):
        assert (_banded_nll(tiny_model(arch, seed=3), ids, other, sinks) - reference).abs().max() > 1e-3
    # the trace holds exactly the budget at the end of every step once the text is longer than it
    kept = [int(step.kept[0, 0]) for step in result.trace.steps]
    assert kept == [min(t + 1, budget) for t in range(TOKENS - 1)]


def test_benchmark_band_is_the_stated_one():
    from confkv.eval.quality import streaming_crosscheck as module
    for budget, sinks in ((9, 0), (9, 2), (5, 4)):
        # the benchmark passes band = budget - sinks (see crosscheck())
        assert torch.equal(module.banded_mask(20, band=budget - sinks, sinks=sinks),
                           _mask_from_statement(20, budget, sinks))


def test_a_budget_is_counted_at_the_end_of_each_step():
    """A window of W holds W full-precision tokens per layer once the text is longer than W: at the end
    of each step exactly the full cache's bytes at min(t + 1, W) tokens (the one byte model)."""
    model = tiny_model("llama")
    shape = kv_shape(model)
    per_token = 2 * 2 * 16 * 4  # K and V, 2 KV heads of dim 16, fp32
    layers, window, steps = 2, 10, 30
    assert shape.token_bytes == per_token and len(shape.sliding_windows) == layers
    expected = [layers * per_token * min(t + 1, window) for t in range(steps)]
    assert [full_cache_bytes(shape, min(t + 1, window)) for t in range(steps)] == expected
    ids = torch.randint(0, 250, (1, steps + 1), generator=torch.Generator().manual_seed(2))
    measured = streaming_ppl(model, ids, "window", progress=False, budget=window).trace
    assert [step.kv_bytes.sum().item() for step in measured.steps] == expected
    assert math.isclose(measured.peak_kv_bytes(), layers * per_token * window)
