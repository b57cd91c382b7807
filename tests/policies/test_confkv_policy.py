"""CONF-KV's keep score, recomputed by hand on a small example.

The attention probabilities, their mean over each KV group's query heads, the EMA update
``ema <- d * ema + (1 - d) * mass`` and the recency bonus ``w * 2 ** (-age / halflife)`` are
computed here with plain loops from the raw queries and keys; the store (attention read +
``observe``) and the policy's ``scores`` must give the same numbers, and eviction must keep
the hand-ranked best slots.
"""

import math

import pytest
import torch

from confkv.config import StoreConfig
from confkv.policies import make_policy
from confkv.store import LayerStore

KV_HEADS, GROUP, DIM, STEPS = 2, 2, 8, 12
DECAY, WEIGHT, HALFLIFE = 0.8, 0.05, 4.0
PROTECT, SINKS = 2, 1


def _hand_ema(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """[Hkv, T] EMA after T single-query steps; queries [T, Hq, D], keys [T, Hkv, D]."""
    steps = keys.shape[0]
    ema = torch.zeros(KV_HEADS, steps, dtype=torch.float64)
    for t in range(steps):
        for kv in range(KV_HEADS):
            mass = [0.0] * (t + 1)
            for g in range(GROUP):
                q = queries[t, kv * GROUP + g].double()
                logits = [float(q @ keys[j, kv].double()) * scaling for j in range(t + 1)]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                for j in range(t + 1):
                    mass[j] += weights[j] / sum(weights) / GROUP
            for j in range(t + 1):  # a new slot starts at 0 and is updated in its own step
                ema[kv, j] = DECAY * ema[kv, j] + (1 - DECAY) * mass[j]
    return ema


def _hand_score(ema: torch.Tensor, current: int) -> torch.Tensor:
    ages = torch.tensor([current - j for j in range(ema.shape[1])], dtype=torch.float64)
    return ema + WEIGHT * 2.0 ** (-ages / HALFLIFE)


@pytest.mark.parametrize("name", ["confkv", "confkv-fixed"])
def test_score_is_ema_of_attention_plus_recency(name):
    params = {"n_high": 100, "n_low": 200} if name == "confkv" else {"budget": 100}
    policy = make_policy(name, ema_decay=DECAY, recency_weight=WEIGHT, recency_halflife=HALFLIFE,
                         protect=PROTECT, sinks=SINKS, **params)
    store = LayerStore(policy, StoreConfig(move_block=1))
    g = torch.Generator().manual_seed(0)
    queries = torch.randn(STEPS, KV_HEADS * GROUP, DIM, generator=g) * 2
    keys = torch.randn(STEPS, KV_HEADS, DIM, generator=g) * 2
    values = torch.randn(STEPS, KV_HEADS, DIM, generator=g)
    scaling = DIM ** -0.5
    for t in range(STEPS):
        store.append(keys[t][None, :, None], values[t][None, :, None])
        store.attend(queries[t][None, :, None], scaling=scaling)
        store.end_step(torch.tensor([100]))  # no eviction yet
    expected = _hand_score(_hand_ema(queries, keys, scaling), STEPS - 1)
    got = {}
    for region in (store.old, store.recent):
        current = torch.tensor([STEPS - 1])
        score = policy.scores(region.stats, region.positions, current)[0]  # [Hkv, L]
        for kv in range(KV_HEADS):
            for slot, position in enumerate(region.positions[0, kv].tolist()):
                got[kv, position] = float(score[kv, slot])
    assert sorted(got) == [(kv, j) for kv in range(KV_HEADS) for j in range(STEPS)]
    for (kv, j), value in got.items():
        assert value == pytest.approx(float(expected[kv, j]), abs=1e-6), (kv, j)
    # the attention part matters here: ranking by recency alone would keep other slots
    assert not torch.equal(expected.argsort(-1), _hand_score(torch.zeros_like(expected), STEPS - 1).argsort(-1))

    # evicting down to `budget` keeps the protected slots plus the best hand-scored others
    budget = 7
    store.end_step(torch.tensor([budget]))
    protected = set(range(SINKS)) | set(range(STEPS - PROTECT, STEPS))
    for kv in range(KV_HEADS):
        others = [j for j in range(STEPS) if j not in protected]
        best = sorted(others, key=lambda j: -float(expected[kv, j]))[:budget - len(protected)]
        held = set()
        for region in (store.old, store.recent):
            held.update(region.positions[0, kv][region.valid[0]].tolist())
        assert held == protected | set(best), kv


@pytest.mark.parametrize("halflife", [64.0, 3.5, 1000.0])
def test_the_recency_bonus_is_two_to_the_minus_age_over_the_half_life_at_every_age(halflife):
    """The bonus comes from a table of ages (so that a slot's score depends on its age alone); at every age, in the
    table and past it (a half-life of 1,000 outgrows the table: those ages are computed), it is ``2 ** (-age / h)``
    as torch's float32 ``exp2(-age / h)`` gives it within a unit or two in the last place (that formula's own
    rounding of ``-age / h`` is kept), and 0 where it rounds to 0."""
    policy = make_policy("confkv-fixed", recency_weight=1.0, recency_halflife=halflife, budget=100)
    ages = torch.cat([torch.arange(0, 70000, 7), torch.tensor([65535, 65536, 65537, 100000, 10 ** 7])])
    current = torch.tensor([10 ** 7])
    positions = (current - ages).view(1, 1, -1)
    scores = policy.scores({"ema": torch.zeros(positions.shape)}, positions, current).flatten().double()
    want = torch.exp2(-ages.float() / halflife).double()
    tiny = want < 2.0 ** -149  # below float32's least subnormal: 0 or that subnormal
    assert bool((scores[tiny] <= 2.0 ** -149).all())
    relative = ((scores - want).abs() / want)[want > 2.0 ** -126]  # normal floats: a few units in the last place
    assert float(relative.max()) < 3e-7
    if halflife == 64.0:  # the preset's: the table ends at the first age that rounds to 0, 9,601 entries
        from confkv.policies.confkv import recency_table
        table, complete = recency_table(halflife, torch.device("cpu"))
        assert complete and table.shape[0] == 9601 and table[-1] == 0 and table[-2] > 0
    subnormal = ~tiny & (want <= 2.0 ** -126)
    assert bool(((scores[subnormal] - want[subnormal]).abs() <= 2.0 ** -149).all())
