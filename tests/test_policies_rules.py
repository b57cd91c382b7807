"""Each baseline policy on hand-made attention patterns with a known answer.

The policies are driven directly (``observe`` with crafted masses, then the cache's own
selection rule :func:`confkv.eviction.select_kept`), or through a :class:`LayerStore`.
"""

import math

import pytest
import torch

from confkv.config import StoreConfig
from confkv.eviction import protected_mask, select_kept
from confkv.policies import make_policy
from confkv.policies.scissorhands import MAX_HISTORY
from confkv.store import LayerStore


def _slots(length: int, batch: int = 1, heads: int = 1):
    positions = torch.arange(length).expand(batch, heads, length).clone()
    valid = torch.ones(batch, length, dtype=torch.bool)
    current = torch.full((batch,), length - 1, dtype=torch.int64)
    return positions, valid, current


def _stats(policy, batch: int, heads: int, length: int):
    return {name: torch.zeros(batch, heads, length) for name in policy.stat_names}


def _kept(policy, stats, positions, valid, current, budget: int) -> list[list[set[int]]]:
    """Positions kept per (sequence, head) when evicting down to ``budget`` (as the store does)."""
    protected = protected_mask(positions, valid, current, policy.protect, policy.sinks)
    scores = policy.scores(stats, positions, current)
    keep = torch.full((positions.shape[0],), budget, dtype=torch.int64)
    keep = torch.maximum(keep, protected.sum(-1).amax(-1))
    index, kept_valid = select_kept(scores, valid, protected, keep)
    kept_pos = positions.gather(2, index)
    return [[{int(p) for p, v in zip(kept_pos[b, h], kept_valid[b]) if v} for h in range(positions.shape[1])]
            for b in range(positions.shape[0])]


def _mass(length: int, weights: dict[int, float], batch: int = 1, heads: int = 1) -> torch.Tensor:
    """One query's attention: ``weights`` on chosen slots, the rest spread evenly."""
    rest = (1.0 - sum(weights.values())) / (length - len(weights))
    m = torch.full((batch, heads, length), rest)
    for j, w in weights.items():
        m[..., j] = w
    return m


# -- H2O -------------------------------------------------------------------------------------------
def test_h2o_keeps_largest_accumulated_mass_plus_recent():
    policy = make_policy("h2o", budget=4, recent_ratio=0.5, protect=0)
    assert policy.n_recent == 2
    positions, valid, current = _slots(10)
    stats = _stats(policy, 1, 1, 10)
    # token 3: steady heavy hitter; token 6: ignored, then the top of the last query only
    for weights in ({3: 0.4, 1: 0.25}, {3: 0.4, 1: 0.25}, {3: 0.3, 1: 0.25}, {6: 0.5, 3: 0.05}):
        policy.observe(stats, _mass(10, weights), 1)
    assert torch.allclose(stats["acc"][0, 0, 3], torch.tensor(1.15))
    assert _kept(policy, stats, positions, valid, current, 4) == [[{1, 3, 8, 9}]]


def test_h2o_per_kv_head_and_per_sequence():
    policy = make_policy("h2o", budget=3, recent_ratio=0.34, protect=0)  # 1 recent + 2 heavy
    positions, valid, current = _slots(8, batch=2, heads=2)
    stats = _stats(policy, 2, 2, 8)
    mass = torch.full((2, 2, 8), 0.01)
    mass[0, 0, [1, 2]] = 0.4   # seq 0, head 0 -> {1, 2}
    mass[0, 1, [4, 5]] = 0.4   # seq 0, head 1 -> {4, 5}
    mass[1, :, [0, 6]] = 0.4   # seq 1, both heads -> {0, 6}
    policy.observe(stats, mass, 1)
    assert _kept(policy, stats, positions, valid, current, 3) == [[{1, 2, 7}, {4, 5, 7}], [{0, 6, 7}, {0, 6, 7}]]


def test_h2o_recent_part_follows_ratio():
    assert make_policy("h2o", budget=100, recent_ratio=0.1, protect=4).n_recent == 10
    assert make_policy("h2o", budget=100, recent_ratio=0.0, protect=4).n_recent == 4  # protect is a floor
    with pytest.raises(ValueError):
        make_policy("h2o", budget=100, recent_ratio=1.5)


# -- TOVA ------------------------------------------------------------------------------------------
def test_tova_keeps_current_query_top_even_if_ignored_before():
    policy = make_policy("tova", budget=3)
    positions, valid, current = _slots(10)
    stats = _stats(policy, 1, 1, 10)
    for weights in ({3: 0.5, 1: 0.4}, {3: 0.5, 1: 0.4}, {6: 0.5, 2: 0.3, 4: 0.1}):
        policy.observe(stats, _mass(10, weights), 1)
    # no accumulation: the old favourites 3 and 1 are gone, the last query's top three stay
    assert _kept(policy, stats, positions, valid, current, 3) == [[{2, 4, 6}]]
    h2o = make_policy("h2o", budget=2, recent_ratio=0.0, protect=0)
    h2o_stats = _stats(h2o, 1, 1, 10)
    for weights in ({3: 0.5, 1: 0.4}, {3: 0.5, 1: 0.4}, {6: 0.5, 2: 0.3, 4: 0.1}):
        h2o.observe(h2o_stats, _mass(10, weights), 1)
    assert _kept(h2o, h2o_stats, positions, valid, current, 2) == [[{1, 3}]]  # accumulation ignores 6
    assert 6 in _kept(policy, stats, positions, valid, current, 1)[0][0]


def test_tova_averages_over_heads_and_heads_keep_the_same_tokens():
    policy = make_policy("tova", budget=1)
    positions, valid, current = _slots(6, heads=2)
    stats = _stats(policy, 1, 2, 6)
    mass = torch.full((1, 2, 6), 0.05)
    mass[0, 0, 2] = 0.6           # head 0 likes token 2 ...
    mass[0, 1, 4] = 0.9           # ... head 1 likes token 4 more: the layer mean picks 4
    policy.observe(stats, mass, 1)
    assert _kept(policy, stats, positions, valid, current, 1) == [[{4}, {4}]]


def test_tova_prefill_chunk_uses_mean_mass():
    policy = make_policy("tova", budget=2)
    stats = _stats(policy, 1, 1, 4)
    policy.observe(stats, torch.tensor([[[2.0, 1.0, 0.5, 0.5]]]), 4)
    assert torch.allclose(stats["attn"], torch.tensor([[[0.5, 0.25, 0.125, 0.125]]]))


# -- Scissorhands ----------------------------------------------------------------------------------
def test_scissorhands_keeps_the_persistent_token_not_the_spike():
    policy = make_policy("scissorhands", budget=3, history=4, threshold=0.1, recent_ratio=0.34, protect=0)
    positions, valid, current = _slots(10)
    stats = _stats(policy, 1, 1, 10)
    # token 2: one huge spike; token 5: moderately above threshold 3 times out of 4
    for weights in ({2: 0.9}, {5: 0.15}, {5: 0.15}, {5: 0.15}):
        policy.observe(stats, _mass(10, weights), 1)
    assert stats["sh_count"][0, 0, 5] == 3 and stats["sh_count"][0, 0, 2] == 1
    assert _kept(policy, stats, positions, valid, current, 3)[0][0] == {5, 2, 9}  # 1 recent + 2 persistent
    assert _kept(policy, stats, positions, valid, current, 2)[0][0] == {5, 9}
    # once the spike is out of the history window it counts for nothing
    policy.observe(stats, _mass(10, {5: 0.15}), 1)
    assert stats["sh_count"][0, 0, 2] == 0 and stats["sh_count"][0, 0, 5] == 4


@pytest.mark.parametrize("history", [1, 5, 24, 30, MAX_HISTORY])
def test_scissorhands_count_is_exact_sliding_window(history):
    policy = make_policy("scissorhands", budget=64, history=history, threshold=0.5, protect=0)
    g = torch.Generator().manual_seed(history)
    stats = _stats(policy, 2, 3, 7)
    hits = []
    for _ in range(2 * MAX_HISTORY + 7):
        mass = torch.rand(2, 3, 7, generator=g)
        hits.append(mass > 0.5)
        policy.observe(stats, mass, 1)
        expected = torch.stack(hits[-history:]).sum(0).float()
        assert torch.equal(stats["sh_count"], expected)


def test_scissorhands_default_threshold_is_one_over_budget():
    assert make_policy("scissorhands", budget=200).effective_threshold == pytest.approx(1 / 200)
    with pytest.raises(ValueError):
        make_policy("scissorhands", history=MAX_HISTORY + 1)


# -- random ----------------------------------------------------------------------------------------
def _random_kept(seed: int, budget: int = 20, length: int = 60):
    policy = make_policy("random", budget=budget, seed=seed, protect=8, sinks=4)
    positions, valid, current = _slots(length, batch=2, heads=2)
    return policy, _kept(policy, {}, positions, valid, current, budget)


def test_random_is_deterministic_per_seed_and_differs_across_seeds():
    _, a = _random_kept(0)
    _, b = _random_kept(0)
    _, c = _random_kept(1)
    assert a == b
    assert a != c
    policy = make_policy("random", seed=3)
    positions, _, current = _slots(50, heads=2)
    torch.testing.assert_close(policy.scores({}, positions, current), policy.scores({}, positions, current))


def test_random_keeps_confkv_protection_and_exact_budget():
    policy, kept = _random_kept(5)
    confkv = make_policy("confkv")
    assert (make_policy("random").protect, make_policy("random").sinks) == (confkv.protect, confkv.sinks)
    for per_seq in kept:
        for heads in per_seq:
            assert len(heads) == 20
            assert set(range(4)) <= heads and set(range(52, 60)) <= heads  # sinks + protect=8
    # heads draw independently
    assert kept[0][0] != kept[0][1]


def test_random_eviction_is_uniform_over_unprotected_slots():
    policy = make_policy("random", budget=12, protect=2, sinks=0)
    counts = torch.zeros(40)
    for step in range(400):
        positions = torch.arange(40).view(1, 1, 40)
        current = torch.tensor([40 + step])  # nothing protected; a fresh draw every step
        scores = policy.scores({}, positions, current)
        counts[scores[0, 0].topk(12).indices] += 1
    expected = 400 * 12 / 40
    assert counts.min() > 0.6 * expected and counts.max() < 1.4 * expected


# -- window / streaming through a real LayerStore ---------------------------------------------------
def _run_store(policy, steps: int, budget: int, batch: int = 2, kv_int8: bool = False, fp_window: int = 4):
    store = LayerStore(policy, StoreConfig(kv_int8=kv_int8, fp_window=fp_window, move_block=3))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        store.append(torch.randn(batch, 2, 1, 8, generator=g), torch.randn(batch, 2, 1, 8, generator=g))
        store.attend(torch.randn(batch, 4, 1, 8, generator=g), scaling=8 ** -0.5)
        store.end_step(torch.full((batch,), budget, dtype=torch.int64))
    return store


def _store_positions(store) -> list[list[set[int]]]:
    out = []
    for b in range(store.seen_real.shape[0]):
        heads = []
        for h in range(store.old.positions.shape[1]):
            kept = set()
            for region in (store.old, store.recent):
                kept |= {int(p) for p, v in zip(region.positions[b, h], region.valid[b]) if v}
            heads.append(kept)
        out.append(heads)
    return out


@pytest.mark.parametrize("kv_int8", [False, True])
def test_window_keeps_exactly_the_last_n(kv_int8):
    store = _run_store(make_policy("window", budget=10), steps=37, budget=10, kv_int8=kv_int8)
    assert _store_positions(store) == [[set(range(27, 37))] * 2] * 2


@pytest.mark.parametrize("kv_int8", [False, True])
def test_streaming_keeps_sinks_plus_last(kv_int8):
    store = _run_store(make_policy("streaming", budget=10, sinks=4), steps=37, budget=10, kv_int8=kv_int8)
    assert _store_positions(store) == [[set(range(4)) | set(range(31, 37))] * 2] * 2


@pytest.mark.parametrize("name", ["h2o", "scissorhands", "tova", "random", "confkv-fixed"])
@pytest.mark.parametrize("kv_int8", [False, True])
def test_store_respects_budget_and_protection(name, kv_int8):
    params = {"budget": 12} if name == "tova" else {"budget": 12, "protect": 3}
    policy = make_policy(name, **params)
    store = _run_store(policy, steps=40, budget=12, kv_int8=kv_int8)
    assert store.kept_counts().tolist() == [12, 12]
    for per_seq in _store_positions(store):
        for kept in per_seq:
            assert set(range(40 - policy.protect, 40)) <= kept and set(range(policy.sinks)) <= kept
            if hasattr(policy, "n_recent"):
                assert set(range(40 - policy.n_recent, 40)) <= kept


# -- confkv-fixed / confkv-l ----------------------------------------------------------------------
def test_confkv_fixed_ranks_like_confkv_with_a_constant_budget():
    fixed = make_policy("confkv-fixed", budget=300)
    gated = make_policy("confkv", n_high=200, n_low=400)
    g = torch.Generator().manual_seed(0)
    positions, valid, current = _slots(500, batch=2, heads=3)
    stats_f, stats_g = _stats(fixed, 2, 3, 500), _stats(gated, 2, 3, 500)
    for _ in range(5):
        mass = torch.rand(2, 3, 500, generator=g)
        fixed.observe(stats_f, mass, 1)
        gated.observe(stats_g, mass, 1)
    torch.testing.assert_close(fixed.scores(stats_f, positions, current), gated.scores(stats_g, positions, current))
    assert _kept(fixed, stats_f, positions, valid, current, 300) == _kept(gated, stats_g, positions, valid, current, 300)
    conf = torch.tensor([0.0, 0.3, 0.99])
    assert torch.equal(fixed.layer_budgets(conf, 4), torch.full((3, 4), 300))
    assert not torch.equal(gated.layer_budgets(conf, 4)[0], gated.layer_budgets(conf, 4)[2])


def test_confkv_l_pyramid_follows_the_gate_per_sequence():
    policy = make_policy("confkv-l", n_high=256, n_low=512, tau=0.5)
    budgets = policy.layer_budgets(torch.tensor([0.9, 0.1]), 30)
    assert budgets.shape == (2, 30)
    assert budgets[0].sum() == 30 * 256 and budgets[1].sum() == 30 * 512
    assert (budgets[:, :-1] >= budgets[:, 1:]).all()
    assert budgets.min() >= policy.floor
    with pytest.raises(ValueError):
        make_policy("confkv-l", n_high=50, n_low=512)  # below the floor of 64


def test_every_baseline_validates_its_fields():
    for name in ("h2o", "scissorhands", "tova", "random", "confkv-fixed"):
        with pytest.raises(ValueError):
            make_policy(name, budget=0)
    with pytest.raises(ValueError):
        make_policy("random", seed=1.5)
    with pytest.raises(ValueError):
        make_policy("confkv-l", beta=0.5)
    assert math.isfinite(make_policy("confkv-l").max_budget())
