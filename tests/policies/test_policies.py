"""Each baseline policy on hand-made attention patterns with a known answer.

The policies are driven directly (``observe`` with crafted masses, then the cache's own
selection rule :func:`confkv.store.hot_tier.select_kept`), or through a :class:`LayerStore`.
"""

import math
import pytest
import torch
from confkv.config import StoreConfig
from confkv.store.hot_tier import protected_mask, select_kept
from confkv.policies.scissorhands import MAX_HISTORY
from confkv.store import LayerStore
from confkv.errors import ConfigError
from confkv.policies import UNLIMITED, make_policy
from confkv.policies.base import Policy
from confkv.policies.fixed_budget import recent_first, recent_part
from confkv.policies.registry import accepted_parameters, policy_parameters
from confkv.policies.tee import TeePolicy


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


# ---------------------------------------------------------------------------------------------------
# Policies on hand-made statistics: the documented field ranges at their edges, and each
# policy's update and score rules against values worked out by hand.
#
# Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).


# -- field ranges, at their edges ----------------------------------------------------------------
@pytest.mark.parametrize("name, params", [
    ("confkv", {"ema_decay": 0.0}), ("confkv", {"recency_weight": 0.0}), ("confkv", {"recency_halflife": 1e-9}),
    ("confkv", {"protect": 0, "sinks": 0}), ("confkv", {"protect": 200, "sinks": 55, "n_high": 256}),
    ("confkv-l", {"beta": 1}), ("confkv-l", {"min_layer_budget": 1, "protect": 0, "sinks": 0, "n_high": 1, "n_low": 1}),
    ("confkv-l", {"n_high": 64, "min_layer_budget": 64}),
    ("h2o", {"budget": 1, "protect": 0, "recent_ratio": 0.0}), ("h2o", {"budget": 64, "recent_ratio": 1.0}),
    ("scissorhands", {"history": 1}), ("scissorhands", {"history": 48}), ("scissorhands", {"threshold": 0.0}),
    ("scissorhands", {"threshold": 0.999}),
    ("random", {"seed": -3}), ("window", {"budget": 1}), ("tova", {"budget": 1}),
])
def test_values_at_the_edge_of_their_range_are_accepted(name, params):
    make_policy(name, **params)


@pytest.mark.parametrize("name, params, field", [
    ("confkv", {"ema_decay": 1.0}, "ema_decay"), ("confkv", {"ema_decay": -0.01}, "ema_decay"),
    ("confkv", {"recency_weight": -1e-9}, "recency_weight"), ("confkv", {"recency_weight": math.inf}, "recency_weight"),
    ("confkv", {"recency_halflife": 0.0}, "recency_halflife"), ("confkv", {"recency_halflife": math.inf}, "recency_halflife"),
    ("confkv", {"protect": -1}, "protect"), ("confkv", {"sinks": -1}, "sinks"), ("confkv", {"protect": True}, "protect"),
    ("confkv", {"protect": 255, "n_high": 256, "sinks": 1}, "sinks"),
    ("confkv", {"protect": 256, "n_high": 256, "sinks": 0}, "protect"),
    ("confkv-l", {"beta": 0.99}, "beta"), ("confkv-l", {"beta": True}, "beta"), ("confkv-l", {"beta": math.inf}, "beta"),
    ("confkv-l", {"min_layer_budget": 0}, "min_layer_budget"), ("confkv-l", {"min_layer_budget": True}, "min_layer_budget"),
    ("confkv-l", {"n_high": 63, "min_layer_budget": 64}, "n_high"),
    ("confkv-l", {"n_high": 36, "min_layer_budget": 1, "protect": 32, "sinks": 4}, "n_high"),
    ("h2o", {"budget": 0}, "budget"), ("h2o", {"budget": True}, "budget"), ("h2o", {"recent_ratio": 1.01}, "recent_ratio"),
    ("h2o", {"recent_ratio": -0.01}, "recent_ratio"), ("h2o", {"recent_ratio": math.nan}, "recent_ratio"),
    ("h2o", {"recent_ratio": True}, "recent_ratio"),
    ("h2o", {"budget": 8, "protect": 4, "sinks": 1, "recent_ratio": 1.0}, "sinks"),
    ("scissorhands", {"history": 0}, "history"), ("scissorhands", {"history": 49}, "history"),
    ("scissorhands", {"history": True}, "history"), ("scissorhands", {"threshold": 1.0}, "threshold"),
    ("scissorhands", {"threshold": -0.1}, "threshold"), ("scissorhands", {"recent_ratio": 2.0}, "recent_ratio"),
    ("scissorhands", {"budget": 8, "protect": 4, "sinks": 1, "recent_ratio": 1.0}, "sinks"),
    ("random", {"seed": True}, "seed"), ("random", {"seed": 1.0}, "seed"),
])
def test_values_out_of_range_name_the_field(name, params, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        make_policy(name, **params)


def test_recent_part_and_recent_first():
    assert recent_part(100, 10, 0.25) == 25
    assert recent_part(100, 30, 0.25) == 30      # the protected tokens wins
    assert recent_part(20, 30, 0.0) == 20        # never more than the budget
    assert recent_part(10, 0, 0.35) == 4         # round(3.5) = 4 (banker's rounding: even)
    positions = torch.arange(6).view(1, 1, 6)
    scores = recent_first(torch.arange(6.0).flip(0).view(1, 1, 6), positions, torch.tensor([5]), n_recent=2)
    assert scores[0, 0].tolist() == [5.0, 4.0, 3.0, 2.0, math.inf, math.inf]


# -- update and score rules, by hand ---------------------------------------------------------------
def test_confkv_ema_update_and_recency_score_by_hand():
    policy = make_policy("confkv", ema_decay=0.75, recency_weight=0.5, recency_halflife=2.0)
    ema = torch.tensor([[[0.2, 0.0, 1.0]]])
    stats = {"ema": ema}
    policy.observe(stats, torch.tensor([[[0.6, 0.9, 0.0]]]), num_queries=3)
    # ema <- 0.75 ema + 0.25 * mass / 3
    assert stats["ema"] is ema
    assert torch.allclose(ema, torch.tensor([[[0.15 + 0.05, 0.075, 0.75]]]))
    positions = torch.tensor([[[3, 5, 9]]])
    scores = policy.scores(stats, positions, torch.tensor([7]))
    # age = 4, 2, 0 (a later position counts as age 0): bonus 0.5 * 2^(-age/2)
    expected = [0.2 + 0.5 * 0.25, 0.075 + 0.5 * 0.5, 0.75 + 0.5 * 1.0]
    assert scores[0, 0].tolist() == pytest.approx(expected, abs=1e-6)
    policy.observe(stats, torch.ones(1, 1, 3), num_queries=0)  # zero queries count as one
    assert stats["ema"][0, 0, 1].item() == pytest.approx(0.75 * 0.075 + 0.25, abs=1e-6)


def test_confkv_budgets_follow_the_gate_at_tau():
    policy = make_policy("confkv", tau=0.5, n_high=100, n_low=300)
    budgets = policy.layer_budgets(torch.tensor([0.5, 0.4999, 1.0]), 2)
    assert budgets.tolist() == [[100, 100], [300, 300], [100, 100]] and budgets.dtype == torch.int64
    assert (policy.min_budget(), policy.max_budget()) == (100, 300)


def test_confkv_l_budgets_bounds_and_gate():
    policy = make_policy("confkv-l", tau=0.5, n_high=100, n_low=200, beta=4.0, min_layer_budget=40)
    assert policy.floor == 40 and policy.min_budget() == 40
    assert policy.max_budget() == math.ceil(2 * 200 - 200 / 4.0)
    assert make_policy("confkv-l", protect=60, sinks=10, min_layer_budget=5, n_high=100).floor == 71
    budgets = policy.layer_budgets(torch.tensor([0.5, 0.2]), 3)
    # k=200: hi = 2k - k/4 = 350, lo = k/4 = 50 -> 350, 200, 50.
    # k=100: 175, 100, 25; the last layer is raised to the floor 40 and the deficit 15 is taken
    # from the others in proportion to their excess (135, 60): 164.6, 95.4, 40 -> 165, 95, 40.
    assert budgets.tolist() == [[165, 95, 40], [350, 200, 50]]
    assert policy.pyramid(100, 3) == [165, 95, 40]


def test_fixed_budget_policies_report_their_budget():
    for name in ("h2o", "tova", "window", "random", "scissorhands", "confkv-fixed"):
        policy = make_policy(name, budget=77)
        assert (policy.min_budget(), policy.max_budget()) == (77, 77), name
        assert policy.layer_budgets(torch.zeros(2), 3).tolist() == [[77] * 3] * 2, name
    assert (make_policy("full").min_budget(), make_policy("full").max_budget()) == (UNLIMITED, UNLIMITED)
    assert make_policy("full").layer_budgets(torch.zeros(1), 2).tolist() == [[UNLIMITED] * 2]


def test_base_policy_scores_are_positions():
    positions = torch.tensor([[[4, 1, 7]]])
    assert Policy().scores({}, positions, torch.tensor([7])).tolist() == [[[4.0, 1.0, 7.0]]]
    assert make_policy("window", budget=4).scores({}, positions, torch.tensor([7])).dtype == torch.float32


def test_h2o_accumulates_and_tova_keeps_only_the_last_mean():
    h2o = make_policy("h2o", budget=8, protect=1, recent_ratio=0.25)
    stats = {"acc": torch.zeros(1, 1, 4)}
    h2o.observe(stats, torch.tensor([[[0.1, 0.2, 0.3, 0.4]]]), 1)
    h2o.observe(stats, torch.tensor([[[0.4, 0.3, 0.2, 0.1]]]), 2)
    assert torch.allclose(stats["acc"], torch.full((1, 1, 4), 0.5))
    assert h2o.n_recent == 2
    scores = h2o.scores(stats, torch.arange(4).view(1, 1, 4), torch.tensor([3]))
    assert scores[0, 0].tolist() == [0.5, 0.5, math.inf, math.inf]
    tova = make_policy("tova", budget=8)
    stats = {"attn": torch.full((1, 2, 3), 9.0)}
    tova.observe(stats, torch.tensor([[[0.2, 0.4, 0.6], [0.6, 0.0, 0.2]]]), 2)
    # mean over the two heads, per query (2 queries): [0.4, 0.2, 0.4] / 2
    assert torch.allclose(stats["attn"], torch.tensor([[[0.2, 0.1, 0.2]] * 2]))
    tova.observe(stats, torch.tensor([[[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]]), 0)
    assert torch.allclose(stats["attn"], torch.tensor([[[1.0, 0.0, 0.0]] * 2]))
    assert tova.scores(stats, torch.zeros(1, 2, 3, dtype=torch.int64), torch.tensor([0])) is stats["attn"]


def test_scissorhands_counts_hits_above_threshold_per_query():
    policy = make_policy("scissorhands", budget=10, history=3, protect=2, recent_ratio=0.2)
    assert policy.effective_threshold == pytest.approx(0.1) and policy.n_recent == 2
    assert make_policy("scissorhands", budget=10, protect=2, threshold=0.3).effective_threshold == 0.3
    stats = {name: torch.zeros(1, 1, 3) for name in policy.stat_names}
    hits = [[0.5, 0.1, 0.0], [0.5, 0.3, 0.0], [0.0, 0.3, 0.0], [0.0, 0.3, 0.0], [0.0, 0.0, 0.0]]
    counts = []
    for mass in hits:  # two queries: the mean mass is compared with 0.1
        policy.observe(stats, torch.tensor([[mass]]), 2)
        counts.append(stats["sh_count"][0, 0].tolist())
    # slot 0: hits at passes 0, 1 -> counts 1, 2, 2, 1 (pass 0 left the 3-pass window), 0
    # slot 1: mean 0.05, 0.15, 0.15, 0.15, 0 -> 0, 1, 2, 3, 2
    assert counts == [[1, 0, 0], [2, 1, 0], [2, 2, 0], [1, 3, 0], [0, 2, 0]]
    scores = policy.scores(stats, torch.tensor([[[0, 1, 2]]]), torch.tensor([5]))
    # count + 0.5 * position / (current + 1); nothing recent (ages 5, 4, 3 >= 2)
    assert scores[0, 0].tolist() == pytest.approx([0.0, 2 + 0.5 / 6, 1 / 6])


def test_random_scores_are_uniform_draws_in_unit_interval():
    policy = make_policy("random", budget=64, seed=5)
    positions = torch.arange(4000).view(1, 1, 4000)
    u = policy.scores({}, positions, torch.tensor([3999]))
    assert u.dtype == torch.float32 and u.shape == (1, 1, 4000)
    assert 0.0 <= u.min().item() and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.02 and abs(u.var().item() - 1 / 12) < 0.01
    assert len(set(u.flatten().tolist())) > 3990  # distinct draws per position


def test_registry_parameters_and_flat_gate_fields():
    params = policy_parameters("confkv")
    assert params["tau"] == 0.5 and params["n_high"] == 256 and params["n_low"] == 512 and params["smoothing"] == 0.0
    assert params["w_entropy"] == 0.4 and params["margin_form"] == "centered"
    assert params["protect"] == 32 and params["sinks"] == 4 and "gate" not in params
    assert policy_parameters("window") == {"protect": 0, "sinks": 0, "budget": 512}
    policy = make_policy("confkv", tau=0.7, w_top=0.5, margin_form="sigmoid", ema_decay=0.5)
    assert policy.gate.tau == 0.7 and policy.gate.n_high == 256 and policy.gate.confidence.w_top == 0.5
    assert policy.gate.confidence.margin_form == "sigmoid" and policy.gate.confidence.w_entropy == 0.4
    assert policy.ema_decay == 0.5
    same = make_policy(policy)
    assert same is policy
    with pytest.raises(ConfigError, match="not both"):
        make_policy(policy, tau=0.1)
    with pytest.raises(ConfigError, match=r"^tau: not a parameter of policy 'window'; its parameters are: budget, protect, sinks$"):
        make_policy("window", tau=0.1)
    with pytest.raises(ConfigError, match=r"^policy: unknown policy 'nope'; known policies: confkv, confkv-fixed"):
        make_policy("nope")


def test_registry_parameters_of_tiered_policies_fold_in_their_cold_tier_defaults():
    # quest.py: streaming's budget 256, protect 0, sinks 4; its cold tier: unquantized (16-bit)
    # pages of 16 tokens, 16 read per step; the rest are ColdConfig's defaults
    assert policy_parameters("quest") == {
        "budget": 256, "protect": 0, "sinks": 4, "bits": 16, "page_size": 16, "group_size": 16,
        "k_high": 16, "k_low": 16, "cold_budget": None, "offload": False, "offload_dir": None, "promote": None,
        "format": "kivi", "outlier_fraction": 0.01, "value_bits": None, "open_bits": 16,
        "rotation_seed": 0}
    params = policy_parameters("confkv-r")  # confkv_r.py: 2-bit pages of 32, 4 pages when confident, 16 not
    assert {k: params[k] for k in ("bits", "page_size", "group_size", "k_high", "k_low", "promote")} == {
        "bits": 2, "page_size": 32, "group_size": 32, "k_high": 4, "k_low": 16, "promote": None}
    assert "cold" not in params and params["tau"] == 0.5 and params["budget"] == 256
    # every listed default is accepted back by make_policy and rebuilds the default policy
    assert make_policy("quest", **policy_parameters("quest")) == make_policy("quest")


def test_tee_names_its_members_statistics_and_feeds_each():
    h2o, tova, window = make_policy("h2o", budget=64), make_policy("tova", budget=64, protect=5), make_policy("window")
    tee = TeePolicy.of([h2o, window, tova])
    assert tee.protect == 32 and tee.name == "tee" and tee.needs_attention
    assert tee.stat_names == ("0.acc", "2.attn")
    assert not TeePolicy.of([window]).needs_attention
    stats = {"0.acc": torch.zeros(1, 1, 2), "2.attn": torch.zeros(1, 1, 2)}
    tee.observe(stats, torch.tensor([[[0.25, 0.75]]]), 1)
    tee.observe(stats, torch.tensor([[[0.5, 0.5]]]), 1)
    assert stats["0.acc"].tolist() == [[[0.75, 1.25]]] and stats["2.attn"].tolist() == [[[0.5, 0.5]]]
    assert tee.member_stats(2, stats) == {"attn": stats["2.attn"]}
    assert tee.layer_budgets(torch.zeros(1), 1).tolist() == [[UNLIMITED]]
    with pytest.raises(ValueError, match="non-empty"):
        TeePolicy(members=())
    with pytest.raises(ValueError, match="non-empty"):
        TeePolicy(members=(h2o, "window"))


def test_register_makes_a_policy_reachable_by_name():
    from dataclasses import dataclass

    from confkv.policies import POLICIES, register

    @dataclass(frozen=True)
    class KeepOldest(Policy):
        name = "test-keep-oldest"

    try:
        assert register(KeepOldest) is KeepOldest
        assert POLICIES["test-keep-oldest"] is KeepOldest
        assert isinstance(make_policy("test-keep-oldest", protect=3), KeepOldest)
    finally:
        POLICIES.pop("test-keep-oldest", None)


def _mix32_by_hand(x: int) -> int:
    mask = 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & mask
    x = (((x >> 16) ^ x) * 0x45D9F3B) & mask
    return (x >> 16) ^ x


@pytest.mark.parametrize("seed", [0, 7, -3])
def test_random_draws_are_the_documented_hash(seed):
    """Pinned so that recorded random-baseline results stay reproducible: ``u = hash(seed,
    position, current_position, kv_head) / 2**32`` with the 32-bit mixer, in plain Python ints."""
    mask = 0xFFFFFFFF
    positions = torch.tensor([0, 1, 5, 1000, 2**33 + 5]).expand(2, 3, 5)  # [B=2, Hkv=3, L=5]
    current = torch.tensor([2**33 + 9, 17])
    u = make_policy("random", budget=64, seed=seed).scores({}, positions, current)
    for b in range(2):
        for head in range(3):
            for j in range(5):
                h = _mix32_by_hand(seed & mask)
                h = _mix32_by_hand(h ^ (int(positions[b, head, j]) & mask))
                h = _mix32_by_hand(h ^ (int(current[b]) & mask))
                h = _mix32_by_hand(h ^ head)
                assert u[b, head, j].item() == torch.tensor(h / 2**32, dtype=torch.float32).item()


@pytest.mark.parametrize("params, message", [
    ({"beta": 0.5}, r"^beta: must be a number >= 1, got 0\.5$"),
    ({"min_layer_budget": 0}, r"^min_layer_budget: must be a positive integer, got 0$"),
    ({"n_high": 50}, r"^n_high: the tight budget n_high=50 .* raise n_high or lower the floor$"),
])
def test_confkv_l_errors_say_what_to_change(params, message):
    with pytest.raises(ConfigError, match=message):
        make_policy("confkv-l", **params)


def test_tee_of_takes_the_widest_member_protection():
    tee = TeePolicy.of([make_policy("h2o", budget=64, protect=5), make_policy("tova", budget=64, protect=7)])
    assert tee.protect == 7
    with pytest.raises(ValueError, match=r"^TeePolicy needs a non-empty tuple of Policy members$"):
        TeePolicy.of([])


def test_tova_layer_mean_per_sequence_in_a_batch():
    tova = make_policy("tova", budget=8)
    mass = torch.tensor([[[0.2, 0.8], [0.4, 0.6]],
                         [[1.0, 0.0], [0.0, 1.0]]])  # [B=2, H=2, L=2]
    stats = {"attn": torch.zeros(2, 2, 2)}
    tova.observe(stats, mass, 1)
    assert torch.allclose(stats["attn"], torch.tensor([[[0.3, 0.7]] * 2, [[0.5, 0.5]] * 2]))


def test_scissorhands_counts_only_attention_strictly_above_the_threshold():
    policy = make_policy("scissorhands", budget=10, protect=2, threshold=0.25, recent_ratio=0.2)
    stats = {name: torch.zeros(1, 1, 3) for name in policy.stat_names}
    policy.observe(stats, torch.tensor([[[0.25, 0.5, 0.25]]]), 1)  # 0.25 is exact in binary
    assert stats["sh_count"].tolist() == [[[0.0, 1.0, 0.0]]]


def test_random_draws_follow_the_positions_device():
    meta = torch.device("meta")  # a device other than the default CPU, available everywhere
    positions = torch.arange(5, device=meta).expand(2, 3, 5)
    u = make_policy("random", budget=64).scores({}, positions, torch.tensor([4, 4]))  # current position on CPU
    assert u.device == meta and u.shape == (2, 3, 5)


@pytest.mark.parametrize("name, field, value", [
    ("random", "seed", 1.5), ("scissorhands", "history", 0), ("scissorhands", "threshold", 1.0),
    ("scissorhands", "recent_ratio", 2.0), ("h2o", "recent_ratio", -1.0), ("h2o", "budget", 0),
    ("confkv", "ema_decay", 1.0), ("confkv", "recency_weight", -1.0), ("confkv", "recency_halflife", 0.0),
    ("confkv", "protect", -1), ("confkv", "sinks", -2), ("confkv-l", "beta", 0.5),
    ("confkv-l", "min_layer_budget", 0),
])
def test_range_errors_say_what_is_allowed_and_what_was_given(name, field, value):
    import re

    with pytest.raises(ConfigError, match=rf"^{field}: must .*, got {re.escape(repr(value))}$"):
        make_policy(name, **{field: value})


def test_pyramid_defaults_are_beta_20_and_no_floor():
    from confkv.policies.pyramid import pyramid_budgets

    assert pyramid_budgets(100, 3) == [195, 100, 5]   # lo = 100/20 = 5, hi = 200 - 5
    assert pyramid_budgets(1, 3) == [2, 1, 0]        # 1.95, 1, 0.05: floors 1, 1, 0 + the leftover on layer 0


def test_recent_part_error_says_what_to_change():
    with pytest.raises(ConfigError, match=r"^sinks: the recent part .* lower `recent_ratio`/`sinks` or raise `budget`$"):
        make_policy("h2o", budget=8, protect=4, sinks=1, recent_ratio=1.0)


def test_confkv_gate_must_be_a_gate_config():
    from confkv.policies.confkv import ConfKVPolicy

    with pytest.raises(ConfigError, match=r"^gate: must be a GateConfig, got dict$"):
        ConfKVPolicy(gate={"tau": 0.5})


def test_accepted_parameters_fold_in_gate_confidence_and_cold_fields_only_where_the_policy_has_them():
    assert accepted_parameters("window") == {"protect", "sinks", "budget"}
    gate = {"gate", "tau", "n_high", "n_low", "smoothing", "w_entropy", "w_margin", "w_top", "margin_form"}
    cold = {"cold", "bits", "page_size", "group_size", "k_high", "k_low", "k", "cold_budget", "offload",
            "offload_dir", "promote", "format", "outlier_fraction", "value_bits", "open_bits", "rotation_seed"}
    assert accepted_parameters("confkv") == {"protect", "sinks", "ema_decay", "recency_weight",
                                             "recency_halflife"} | gate
    assert accepted_parameters("quest") == {"protect", "sinks", "budget"} | cold
    assert accepted_parameters("confkv-r") == {"protect", "sinks", "ema_decay", "recency_weight",
                                               "recency_halflife", "budget"} | gate | cold


def test_flat_gate_and_cold_parameters_override_a_given_base_object_field_by_field():
    # a GateConfig / ColdConfig passed whole keeps its other fields when flat parameters override some
    from confkv.config import ColdConfig, GateConfig

    policy = make_policy("confkv", gate=GateConfig(tau=0.9, n_high=64, n_low=128), n_low=256)
    assert (policy.gate.tau, policy.gate.n_high, policy.gate.n_low) == (0.9, 64, 256)
    tiered = make_policy("confkv-r", budget=64, protect=8, cold=ColdConfig(bits=2, page_size=16, group_size=16), k=3)
    assert (tiered.cold.bits, tiered.cold.page_size, tiered.cold.k_high, tiered.cold.k_low) == (2, 16, 3, 3)


def test_a_policy_object_with_parameters_is_refused_with_its_message():
    with pytest.raises(ConfigError) as refused:
        make_policy(make_policy("h2o", budget=64), budget=48)
    assert str(refused.value) == "policy: pass either a Policy object or a name with parameters, not both"


def test_protection_refusals_give_the_window_and_the_smallest_budget():
    with pytest.raises(ConfigError) as refused:
        make_policy("h2o", budget=8, protect=8)
    assert str(refused.value) == ("protect: the protected tokens P=8 must be smaller than the smallest budget (8); "
                                  "lower `protect` or raise the budget")
    with pytest.raises(ConfigError) as refused:
        make_policy("h2o", budget=8, protect=5, sinks=3)
    assert str(refused.value) == ("sinks: protect + sinks = 8 must be smaller than the smallest budget (8); "
                                  "lower `sinks`/`protect` or raise the budget")


def test_an_unlimited_budget_refuses_no_protection_window():
    # the window must be smaller than the smallest *finite* budget; with none, any window goes
    assert make_policy("h2o", budget=UNLIMITED, protect=UNLIMITED).protect == UNLIMITED
