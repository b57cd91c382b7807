"""Every registered policy through ``ConfKVCache`` + ``model.generate`` on a tiny Llama.

Checked for each policy, at batch 1 and 2 (left padding), with INT8 storage off and on:

- after every forward pass, every managed layer keeps at most the policy's budget for
  that layer and sequence (``cache.trace`` and ``cache.kept_counts()``);
- the ``protect`` most recent tokens and the ``sinks`` first tokens are still there;
- running twice gives the same tokens and the same kept slots (seeded policies included);
- with a budget larger than the sequence, the output equals ``DynamicCache``'s
  (same tokens, logits within 1e-4).

Parameters are derived from each policy's fields, so a newly registered policy joins
the matrix automatically.
"""

from dataclasses import fields

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from confkv.config import StoreConfig
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from confkv.policies import POLICIES, UNLIMITED
from thread_counts import torch_threads

PROMPT, NEW, PAD = 40, 24, 258
BUDGET, PROTECT, FP_WINDOW = 24, 8, 8


def _params(name: str, budget: int) -> dict:
    """Small-or-large budget parameters for policy ``name``, from its fields."""
    names = {f.name for f in fields(POLICIES[name])}
    defaults = POLICIES[name]()
    params: dict = {}
    if "budget" in names:
        params["budget"] = budget
    if "gate" in names:
        params.update(n_high=budget, n_low=budget + 8, tau=0.5)
    if "min_layer_budget" in names:
        params["min_layer_budget"] = 16
    if defaults.protect > PROTECT:
        params["protect"] = PROTECT
    return params


def _prompt(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 250, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones(batch, PROMPT, dtype=torch.long)
    if batch > 1:
        mask[1, :6] = 0
        ids[1, :6] = PAD
    return ids, mask


class _Checker(LogitsProcessor):
    """Called after each forward pass (after the cache's end of step): checks the cache's state."""

    def __init__(self, cache: ConfKVCache) -> None:
        self.cache = cache
        self.snapshots: list[list] = []
        self.calls = 0

    def __call__(self, input_ids, scores):
        cache, policy = self.cache, self.cache.policy
        self.calls += 1
        assert len(cache.trace) == self.calls
        record = cache.trace.steps[-1]
        kept = cache.kept_counts()
        assert torch.equal(kept, record.kept)
        budgets = policy.layer_budgets(record.confidence, len(cache.managed))  # [B, managed]
        for j, layer in enumerate(cache.managed):
            assert (kept[layer] <= budgets[:, j].clamp(max=UNLIMITED)).all(), (layer, kept[layer], budgets[:, j])
        snapshot = []
        for layer in cache.managed:
            store = cache.layers[layer].store
            for b in range(kept.shape[1]):
                current = int(store.seen_real[b]) - 1
                must = set(range(max(0, current - policy.protect + 1), current + 1)) | set(range(min(policy.sinks, current + 1)))
                for h in range(store.recent.positions.shape[1]):
                    have = set()
                    for region in (store.old, store.recent):
                        have |= {int(p) for p, v in zip(region.positions[b, h], region.valid[b]) if v}
                    assert must <= have, (policy.name, layer, b, h, sorted(must - have))
                    snapshot.append(sorted(have))
        self.snapshots.append(snapshot)
        return scores


def _run(model, name, params, ids, mask, kv_int8, fp_window=FP_WINDOW):
    store = StoreConfig(kv_int8=kv_int8, fp_window=fp_window, move_block=4)
    cache = ConfKVCache.for_model(model, name, store=store, **params)
    checker = _Checker(cache)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, cache=cache,
                         logits_processor=LogitsProcessorList([checker]), pad_token_id=PAD,
                         output_logits=True, return_dict_in_generate=True)
    return out, cache, checker


@pytest.fixture(scope="module")
def model():
    with torch_threads(1):  # tiny matrices: extra threads only contend on a shared machine
        yield tiny_model("llama", seed=11)


@pytest.mark.parametrize("kv_int8", [False, True], ids=["fp", "int8"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_budget_protection_determinism(model, name, batch, kv_int8):
    ids, mask = _prompt(batch)
    params = _params(name, BUDGET)
    out, cache, checker = _run(model, name, params, ids, mask, kv_int8)
    assert checker.calls == NEW
    if name != "full":  # the budget really bites
        assert int(cache.kept_counts()[cache.managed].min()) < PROMPT
    again, _, checker2 = _run(model, name, params, ids, mask, kv_int8)
    assert torch.equal(out.sequences, again.sequences)
    assert checker.snapshots == checker2.snapshots


@pytest.mark.parametrize("kv_int8", [False, True], ids=["fp", "int8"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_exact_when_budget_exceeds_sequence(model, name, batch, kv_int8):
    """With INT8 on, an FP window as long as the sequence quantizes nothing: still exact."""
    ids, mask = _prompt(batch)
    params = _params(name, 4000)
    if kv_int8 and "min_layer_budget" in params:
        params["min_layer_budget"] = 2 * (PROMPT + NEW)  # above fp_window + sinks
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         cache=DynamicCache(config=model.config), pad_token_id=PAD,
                         output_logits=True, return_dict_in_generate=True)
    out, cache, _ = _run(model, name, params, ids, mask, kv_int8=kv_int8, fp_window=PROMPT + NEW)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(ref.logits, 1), atol=1e-4, rtol=1e-4)
    assert torch.equal(cache.kept_counts()[:, 0], torch.full((len(cache.layers),), PROMPT + NEW - 1))
