"""SnapKV (``confkv.policies.snapkv``): votes of the last pass, pooled along the slots, each KV head on its own.

Expected values are written out by hand; the whole-cache test checks that under the query-aware protocol the
kept tokens are those the observation window voted for, and not those an earlier chunk attended to.
"""

import pytest
import torch

from confkv.errors import ConfigError
from confkv.hf import ConfKVCache, prefill
from confkv.models import tiny_model
from confkv.policies import make_policy


def _stats(votes: list[list[float]]) -> dict[str, torch.Tensor]:
    return {"attn": torch.tensor([votes], dtype=torch.float32)}  # [1, Hkv, L]


def _positions(length: int, heads: int = 1) -> torch.Tensor:
    return torch.arange(length).expand(1, heads, length)


def test_scores_are_the_votes_averaged_over_a_centred_window():
    policy = make_policy("snapkv", budget=8, protect=1, kernel_size=3)
    stats = _stats([[0.0, 0.0, 0.9, 0.0, 0.0, 0.3]])
    scores = policy.scores(stats, _positions(6), torch.tensor([5]))
    # each slot: the mean of itself and its two neighbours, the padding beyond the ends counted as 0
    expected = torch.tensor([[[0.0, 0.3, 0.3, 0.3, 0.1, 0.1]]])
    torch.testing.assert_close(scores, expected)


def test_kernel_one_ranks_on_the_votes_alone():
    policy = make_policy("snapkv", budget=8, protect=1, kernel_size=1)
    stats = _stats([[0.1, 0.7, 0.2]])
    assert torch.equal(policy.scores(stats, _positions(3), torch.tensor([2])), stats["attn"])


def test_observe_keeps_the_last_pass_only_as_its_mean_per_query():
    policy = make_policy("snapkv", budget=8, protect=1)
    stats = _stats([[5.0, 5.0, 5.0]])
    policy.observe(stats, torch.tensor([[[2.0, 0.0, 4.0]]]), num_queries=4)
    torch.testing.assert_close(stats["attn"], torch.tensor([[[0.5, 0.0, 1.0]]]))


def test_each_kv_head_ranks_on_its_own_votes():
    policy = make_policy("snapkv", budget=8, protect=1, kernel_size=1)
    stats = {"attn": torch.tensor([[[0.9, 0.1, 0.0], [0.0, 0.1, 0.9]]])}
    scores = policy.scores(stats, _positions(3, heads=2), torch.tensor([2]))
    assert scores[0, 0].argmax() == 0 and scores[0, 1].argmax() == 2


def test_the_window_is_the_protected_tokens_and_protect_zero_lets_every_query_vote():
    assert make_policy("snapkv", budget=8, protect=5).observation_window() == 5
    assert make_policy("snapkv", budget=8, protect=0).observation_window() is None


@pytest.mark.parametrize("bad", [0, 2, -3, 1.0, True, "5"])
def test_a_kernel_that_is_not_a_positive_odd_integer_is_refused_by_name(bad):
    with pytest.raises(ConfigError, match="kernel_size"):
        make_policy("snapkv", budget=8, protect=1, kernel_size=bad)


def _recorded_passes(monkeypatch) -> list[tuple[torch.Tensor, int]]:
    from confkv.policies.snapkv import SnapKVPolicy

    passes: list[tuple[torch.Tensor, int]] = []
    observe = SnapKVPolicy.observe

    def recorded(self, stats, mass, num_queries):
        passes.append((mass.clone(), num_queries))
        observe(self, stats, mass, num_queries)

    monkeypatch.setattr(SnapKVPolicy, "observe", recorded)
    return passes


def _per_layer(passes: list[tuple[torch.Tensor, int]], length: int) -> list[torch.Tensor]:
    """Each layer's masses over its older region then its recent slots, joined in slot order."""
    joined, part = [], []
    for mass, _ in passes:
        part.append(mass)
        if sum(m.shape[-1] for m in part) == length:
            joined.append(torch.cat(part, dim=-1))
            part = []
    assert not part
    return joined


def test_under_the_query_aware_protocol_the_window_decides_what_stays(monkeypatch):
    """Fill a cache with eviction deferred, then compress after a last chunk (the observation window): the kept
    slots of every layer and head are the best of the window's pooled votes, worked out here from the attention
    mass the window's pass handed each layer's policy, and not from any earlier chunk's."""
    passes = _recorded_passes(monkeypatch)
    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=2)
    budget, window, prompt = 12, 4, 40
    cache = ConfKVCache.for_model(model, "snapkv", budget=budget, protect=window, kernel_size=3)
    ids = torch.randint(3, model.config.vocab_size, (1, prompt))
    mask = torch.ones_like(ids)
    cache.evict = False
    prefill(model, cache, ids[:, :prompt - window], mask[:, :prompt - window], chunk=16)
    passes.clear()
    logits = prefill(model, cache, ids[:, prompt - window:], mask, chunk=16)  # the window's pass
    layers = [layer.store for layer in cache.layers]
    assert all(q == window for _, q in passes)
    votes = [mass / window for mass in _per_layer(passes, prompt)]
    assert len(votes) == len(layers)
    positions = [torch.cat([store.old.positions, store.recent.positions], dim=-1) for store in layers]
    assert all(p.shape[-1] == prompt for p in positions)
    cache.evict = True
    cache.end_step(logits)
    policy = make_policy("snapkv", budget=budget, protect=window, kernel_size=3)
    for store, vote, position in zip(layers, votes, positions):
        kept = torch.cat([store.old.positions, store.recent.positions], dim=-1).sort(-1).values
        assert kept.shape[-1] == budget
        older = budget - window  # the window (protected) stays; the rest of the budget goes by pooled votes
        scores = policy.scores({"attn": vote}, position, torch.tensor([prompt - 1]))
        unprotected = position < prompt - window
        best = scores.masked_fill(~unprotected, float("-inf")).topk(older, dim=-1).indices
        expected = torch.cat([position.gather(-1, best), torch.arange(prompt - window, prompt).expand(
            1, position.shape[1], window)], dim=-1).sort(-1).values
        assert torch.equal(kept, expected)


def test_one_pass_over_the_whole_prompt_votes_with_its_last_window_only(monkeypatch):
    """A prompt in one pass (as ``model.generate`` feeds it) is ranked by the attention of its last ``protect``
    queries: the masses the policy observes equal those of the window fed as a pass of its own after the rest
    (eviction deferred), the kept tokens are the same, and the pass's output is the full cache's."""
    passes = _recorded_passes(monkeypatch)
    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=2)
    budget, window, prompt = 12, 4, 40
    ids = torch.randint(3, model.config.vocab_size, (1, prompt))
    mask = torch.ones_like(ids)

    one = ConfKVCache.for_model(model, "snapkv", budget=budget, protect=window, kernel_size=3)
    logits_one = prefill(model, one, ids, mask, chunk=64)  # one pass of 40 queries, then eviction
    assert passes and all(q == window for _, q in passes)
    votes_one = _per_layer(passes, prompt)

    passes.clear()
    two = ConfKVCache.for_model(model, "snapkv", budget=budget, protect=window, kernel_size=3)
    two.evict = False
    prefill(model, two, ids[:, :prompt - window], mask[:, :prompt - window], chunk=64)
    passes.clear()
    logits_two = prefill(model, two, ids[:, prompt - window:], mask, chunk=64)
    two.evict = True
    two.end_step(logits_two)
    votes_two = _per_layer(passes, prompt)

    assert len(votes_one) == len(votes_two) == len(one.layers)
    for a, b in zip(votes_one, votes_two):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for layer_one, layer_two in zip(one.layers, two.layers):
        kept = [torch.cat([s.old.positions, s.recent.positions], -1).sort(-1).values
                for s in (layer_one.store, layer_two.store)]
        assert torch.equal(*kept)

    full = ConfKVCache.for_model(model, "full")
    torch.testing.assert_close(logits_one, prefill(model, full, ids, mask, chunk=64), atol=1e-5, rtol=0)
