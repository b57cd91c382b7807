"""The tiered store: low-bit packing, page digests, exactness, bounded and offloaded cold tiers.

References are independent of the code under test: transformers' DynamicCache, a dense
float64 computation of ``q . k``, byte counts written out by hand.
"""

from __future__ import annotations

import os
import stat
import tempfile

import pytest
import torch
from transformers import DynamicCache

from confkv.tiers import lowbit
from confkv.tiers.cold import ColdTier
from confkv.config import ALL_PAGES, ColdConfig
from confkv.errors import ConfigError
from confkv.hf import ConfKVCache, generate
from confkv.models import SUPPORTED_TINY_ARCHS, tiny_model
from confkv.policies import make_policy

pytestmark = pytest.mark.usefixtures("one_thread")

PAD = 258
NEW = 10


# ------------------------------------------------------------------ packing and quantization

@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_roundtrip_and_width(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), generator=torch.Generator().manual_seed(bits)).to(torch.uint8)
    packed = lowbit.pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == 64 * bits // 8  # dense: bits/8 bytes per code
    assert torch.equal(lowbit.unpack(packed, bits, 64), codes.to(torch.int32))
    # the read path's table lookup gives the same codes, as float32
    assert torch.equal(lowbit.unpack_float(packed, bits, 64), codes.float())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_dequantized_codes_are_minimum_plus_code_times_scale(bits):
    """The read path's fused form against the KIVI formula worked out element by element."""
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (2, 4, 8), generator=gen).to(torch.uint8)  # [pages, P=4, D=8]
    key_scale, key_min = torch.rand(2, 2, 8, generator=gen).half(), torch.randn(2, 2, 8, generator=gen).half()
    keys = lowbit.dequantize_keys(lowbit.Quantized(lowbit.pack(codes, bits), key_scale, key_min), bits, 8, 2)
    value_scale, value_min = torch.rand(2, 4, 4, generator=gen).half(), torch.randn(2, 4, 4, generator=gen).half()
    values = lowbit.dequantize_values(lowbit.Quantized(lowbit.pack(codes, bits), value_scale, value_min), bits, 8, 2)
    for page in range(2):
        for token in range(4):
            for channel in range(8):
                code = float(codes[page, token, channel])
                k_ref = float(key_min[page, token // 2, channel]) + code * float(key_scale[page, token // 2, channel])
                v_ref = float(value_min[page, token, channel // 2]) + code * float(value_scale[page, token, channel // 2])
                assert keys[page, token, channel].item() == pytest.approx(k_ref, rel=1e-6, abs=1e-6)
                assert values[page, token, channel].item() == pytest.approx(v_ref, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantization_error_within_half_a_step(bits):
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 4, 32, 16, generator=gen) * torch.linspace(0.1, 8, 16)  # outlier channels
    values = torch.randn(2, 3, 4, 32, 16, generator=gen)
    valid = torch.ones(2, 3, 4, 32, dtype=torch.bool)
    qk = lowbit.quantize_keys(keys, valid, bits, group_size=8)
    qv = lowbit.quantize_values(values, bits, group_size=8)
    assert qk.scale.shape == (2, 3, 4, 4, 16) and qv.scale.shape == (2, 3, 4, 32, 2)
    k_hat = lowbit.dequantize_keys(qk, bits, 16, 8)
    v_hat = lowbit.dequantize_values(qv, bits, 16, 8)
    # per group: range / (2^bits - 1) / 2, plus float16 rounding of scale and minimum
    k_groups = keys.reshape(2, 3, 4, 4, 8, 16)
    k_step = (k_groups.amax(-2) - k_groups.amin(-2)) / ((1 << bits) - 1)
    k_err = (k_hat - keys).abs().reshape(2, 3, 4, 4, 8, 16).amax(-2)
    assert (k_err <= k_step / 2 + 2e-3 * keys.abs().amax() + (1 << bits) * 1e-3 * k_step).all()
    v_groups = values.reshape(2, 3, 4, 32, 2, 8)
    v_step = (v_groups.amax(-1) - v_groups.amin(-1)) / ((1 << bits) - 1)
    v_err = (v_hat - values).abs().reshape(2, 3, 4, 32, 2, 8).amax(-1)
    assert (v_err <= v_step / 2 + 2e-3 * values.abs().amax() + (1 << bits) * 1e-3 * v_step).all()


def test_invalid_slots_do_not_widen_the_key_range():
    keys = torch.zeros(1, 1, 1, 4, 8)
    keys[..., 3, :] = 1000.0  # a padding slot with a huge key
    valid = torch.tensor([True, True, True, False]).reshape(1, 1, 1, 4)
    keys[..., :3, :] = torch.tensor([0.0, 0.5, 1.0])[:, None]
    q = lowbit.quantize_keys(keys, valid, 2, group_size=4)
    k_hat = lowbit.dequantize_keys(q, 2, 8, 4)
    torch.testing.assert_close(k_hat[..., :3, :], keys[..., :3, :], atol=0.17, rtol=0)


# ------------------------------------------------------------------ the tier on its own

def _filled_tier(bits=16, page=4, tokens=40, heads=2, dim=16, seed=0, loud=None, **extra) -> tuple[ColdTier, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tier = ColdTier(ColdConfig(bits=bits, page_size=page, group_size=page, k_high=2, k_low=2, **extra))
    keys = torch.randn(1, heads, tokens, dim, generator=gen)
    if loud is not None:  # one token with a key far larger than the rest
        keys[:, :, loud] *= 10
    values = torch.randn(1, heads, tokens, dim, generator=gen)
    positions = torch.arange(tokens).expand(1, heads, tokens).clone()
    for start in range(0, tokens, 7):  # demoted in uneven groups, as eviction does
        end = min(start + 7, tokens)
        tier.demote(keys[:, :, start:end], values[:, :, start:end], positions[:, :, start:end],
                    torch.ones(1, end - start, dtype=torch.bool))
    return tier, keys


def test_digest_bounds_every_score_of_its_page():
    tier, keys = _filled_tier(tokens=40, page=4)
    query = torch.randn(1, 4, 3, 16, generator=torch.Generator().manual_seed(1))  # GQA: 2 query heads per KV head
    bound = tier.digest_bound(query)  # [1, 2, 10]
    grouped = query.double().reshape(1, 2, 6, 16)
    scores = grouped @ keys.double().transpose(-1, -2)  # [1, 2, 6, 40]
    true_max = scores.amax(2).reshape(1, 2, 10, 4).amax(-1)
    assert (bound.double() >= true_max - 1e-2).all()  # float16 digest rounding


def test_the_page_holding_the_best_key_is_read():
    tier, keys = _filled_tier(tokens=40, page=4, loud=29)
    query = torch.zeros(1, 2, 1, 16)
    query[0, :, 0] = keys[0, :, 29] * 50  # aligned with token 29 (page 7) in both heads
    segments = tier.segments(query, torch.tensor([1]))
    assert len(segments) == 1  # 40 tokens fill 10 pages: no open page, one page segment
    page_segment = segments[-1]
    assert page_segment.keys.shape[2] == 4
    torch.testing.assert_close(page_segment.keys[0, :, 1], keys[0, :, 29])  # bits=16: exact


def test_cold_budget_keeps_flat_memory_and_the_hottest_pages():
    tier, _ = _filled_tier(tokens=40, page=4, cold_budget=12)
    assert int(tier.token_count()) <= 12
    first = tier.kv_bytes()
    more = torch.randn(1, 2, 40, 16)
    tier.demote(more, more, torch.arange(40, 80).expand(1, 2, 40).clone(), torch.ones(1, 40, dtype=torch.bool))
    assert int(tier.token_count()) <= 12
    assert tier.kv_bytes() == first  # an endless stream stays flat
    assert tier.pages["positions"][0, 0, :tier.num_pages].min() >= 68  # nothing read: the oldest pages went first


def _read_all_and_observe(tier: ColdTier, page_mass: list[float]) -> None:
    """One attention read of every page, then the given attention mass per page (spread over its slots)."""
    query = torch.zeros(1, 1, 1, tier.head_dim)
    tier.segments(query, torch.tensor([tier.num_pages]))
    page = tier.config.page_size
    slots = torch.tensor(page_mass).repeat_interleave(page) / page
    tier.observe(slots.reshape(1, 1, -1))


def _demote(tier: ColdTier, start: int, count: int) -> None:
    chunk = torch.randn(1, 1, count, 16, generator=torch.Generator().manual_seed(start))
    tier.demote(chunk, chunk, torch.arange(start, start + count).reshape(1, 1, count), torch.ones(1, count, dtype=torch.bool))


def _page_starts(tier: ColdTier) -> list[int]:
    return tier.pages["positions"][0, 0, :tier.num_pages, 0].tolist()


def test_cold_budget_evicts_the_least_attention_per_read_and_keeps_new_pages():
    """Heat is attention per read since sealing: a new page is not evicted before it is read,
    and an old page's larger total does not outweigh a younger page's larger mean."""
    tier = ColdTier(ColdConfig(bits=16, page_size=4, group_size=4, k_high=1, k_low=1, cold_budget=12))
    _demote(tier, 0, 12)  # pages A (0-3), B (4-7), C (8-11)
    _read_all_and_observe(tier, [0.6, 0.3, 0.1])
    _demote(tier, 12, 4)  # page D, never read: kept; C (0.1 per read) goes
    assert _page_starts(tier) == [0, 4, 12]
    _read_all_and_observe(tier, [0.0, 0.32, 0.5])  # means: A 0.30, B 0.31, D 0.50; totals: A 0.6, B 0.62, D 0.5
    _demote(tier, 16, 4)  # page E: kept; A (lowest mean, though not the lowest total) goes
    assert _page_starts(tier) == [4, 12, 16]
    twin = tier.clone()  # the read clock travels with a clone
    assert twin.reads == tier.reads == 2


# ------------------------------------------------------------------ exactness through transformers

def _prompt(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(1, batch):
        mask[b, : 5 * b] = 0
        ids[b, : 5 * b] = PAD
    return ids, mask


def _run(model, cache, ids, mask, chunk=16):
    kwargs = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  pad_token_id=PAD, attention_mask=mask)
    if cache is None:
        out = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
    else:
        out = generate(model, ids, cache, chunk=chunk, **kwargs)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("policy", ["confkv-r", "quest", "kivi"])
@pytest.mark.parametrize("batch", [1, 2])
def test_hot_budget_covering_everything_equals_dynamic_cache(policy, batch):
    model = tiny_model("llama", seed=1)
    ids, mask = _prompt(batch, 60)
    ref_tokens, ref_logits = _run(model, None, ids, mask)
    cache = ConfKVCache.for_model(model, policy, budget=200, page_size=8, group_size=8)
    tokens, logits = _run(model, cache, ids, mask)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert all(int(layer.store.cold_counts().sum()) == 0 for layer in cache.layers)


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
@pytest.mark.parametrize("batch", [1, 3])
def test_cold_tier_read_in_full_at_16_bits_equals_no_eviction(arch, batch):
    """Every evicted token demoted unquantized and read back: the same attention as keeping everything."""
    model = tiny_model(arch, seed=2)
    ids, mask = _prompt(batch, 70, seed=4)
    ref_tokens, ref_logits = _run(model, None, ids, mask)
    cache = ConfKVCache.for_model(model, "confkv-r", budget=24, protect=8, bits=16, page_size=8, group_size=8,
                                  k=ALL_PAGES)
    tokens, logits = _run(model, cache, ids, mask)
    managed = [cache.layers[i].store for i in cache.managed]
    assert all(int(s.cold_counts().min()) > 0 for s in managed)  # eviction did happen
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("int8", [False, True])
def test_cold_tier_read_in_full_at_8_bits_is_within_quantization_error(int8):
    from confkv.config import StoreConfig

    model = tiny_model("llama", seed=3)
    ids, mask = _prompt(1, 80, seed=5)
    ref_tokens, ref_logits = _run(model, None, ids, mask)
    store = StoreConfig(kv_int8=True, fp_window=8) if int8 else None
    cache = ConfKVCache.for_model(model, "confkv-r", store=store, budget=24, protect=8, bits=8, page_size=8,
                                  group_size=8, k=ALL_PAGES)
    tokens, logits = _run(model, cache, ids, mask)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=2e-2, rtol=0)
    # and it is not exact: the cold pages really are quantized
    assert (logits - ref_logits).abs().max() > 1e-6


def test_reading_fewer_pages_changes_the_output_and_the_bytes_read():
    model = tiny_model("llama", seed=3)
    ids, mask = _prompt(1, 80, seed=6)
    results = {}
    for k in (0, 2, ALL_PAGES):
        cache = ConfKVCache.for_model(model, "confkv-r", budget=24, protect=8, bits=16, page_size=8, group_size=8, k=k)
        _, logits = _run(model, cache, ids, mask)
        results[k] = (logits, cache.trace.steps[-1].cold_bytes_read)
    assert results[0][1] < results[2][1] < results[ALL_PAGES][1]
    assert not torch.allclose(results[0][0], results[ALL_PAGES][0], atol=1e-3)


def test_the_gate_picks_the_read_budget_from_confidence():
    policy = make_policy("confkv-r", tau=0.5, k_high=1, k_low=5)
    assert policy.cold_read_pages(torch.tensor([0.9, 0.1, 0.5])).tolist() == [1, 5, 1]
    inverted = make_policy("confkv-r", tau=0.5, k_high=5, k_low=1)
    assert inverted.cold_read_pages(torch.tensor([0.9, 0.1])).tolist() == [5, 1]
    assert make_policy("quest", k=3).cold_read_pages(torch.tensor([0.9, 0.1])).tolist() == [3, 3]


# ------------------------------------------------------------------ offload

def test_offloaded_tier_matches_the_in_memory_one_and_leaves_no_file(tmp_path, monkeypatch):
    model = tiny_model("llama", seed=3)
    ids, mask = _prompt(1, 80, seed=7)
    created = []
    real_mkstemp = tempfile.mkstemp

    def spy(*args, **kwargs):
        fd, path = real_mkstemp(*args, **kwargs)
        created.append((path, stat.S_IMODE(os.stat(path).st_mode)))
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", spy)
    params = dict(budget=24, protect=8, bits=4, page_size=8, group_size=8, k=3)
    in_ram = ConfKVCache.for_model(model, "confkv-r", **params)
    offloaded = ConfKVCache.for_model(model, "confkv-r", offload=True, offload_dir=str(tmp_path), **params)
    _, logits_ram = _run(model, in_ram, ids, mask)
    _, logits_off = _run(model, offloaded, ids, mask)
    assert torch.equal(logits_ram, logits_off)
    assert offloaded.kv_bytes() == in_ram.kv_bytes()
    assert 0 < offloaded.offloaded_bytes() < offloaded.kv_bytes()
    assert in_ram.offloaded_bytes() == 0
    assert len(created) == 1 and created[0][0].startswith(str(tmp_path)) and created[0][1] == 0o600
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing left, even after a crash
    offloaded.close()


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("params, field", [
    ({"bits": 5}, "bits"), ({"bits": 1}, "bits"), ({"page_size": 0}, "page_size"),
    ({"group_size": 3, "page_size": 8}, "group_size"), ({"k_low": -1}, "k_low"),
    ({"k_high": 4, "cold_budget": 64, "page_size": 32, "group_size": 32}, "k_high"),
    ({"offload_dir": "/nonexistent/confkv"}, "offload_dir"),
])
def test_bad_cold_settings_name_the_field(params, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        make_policy("confkv-r", **params)


def test_unwritable_offload_dir_is_refused_before_anything_is_written(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores the mode bits
            pytest.skip("running as root: a read-only directory is still writable")
        with pytest.raises(ConfigError, match="^offload_dir:"):
            make_policy("confkv-r", offload=True, offload_dir=str(locked))
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_head_dim_that_three_bit_codes_cannot_pack_is_refused():
    tier = ColdTier(ColdConfig(bits=3, page_size=4, group_size=4))
    keys = torch.randn(1, 1, 4, 12)
    with pytest.raises(ValueError, match="bits"):
        tier.demote(keys, keys, torch.arange(4).reshape(1, 1, 4), torch.ones(1, 4, dtype=torch.bool))


# ------------------------------------------------------------------ through the NIAH harness

@pytest.mark.parametrize("protocol", ["query-aware", "streaming"])
def test_niah_protocols_with_all_pages_read_unquantized_answer_as_full(protocol):
    from confkv.config import StoreConfig
    from confkv.data import make_niah_sample
    from confkv.eval.niah import run_niah_batch
    from confkv.models import tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    samples = [make_niah_sample(tok, context_tokens=150, depth=d, trial=0) for d in (0.2, 0.8)]
    tiered = {"budget": 24, "protect": 4, "bits": 16, "page_size": 8, "group_size": 8, "k": ALL_PAGES}
    full = run_niah_batch(model, tok, samples, "full", {}, protocol, store=StoreConfig(), chunk=48, max_new_tokens=4)
    recalled = run_niah_batch(model, tok, samples, "confkv-r", tiered, protocol, store=StoreConfig(), chunk=48,
                              max_new_tokens=4)
    assert [o[0] for o in recalled] == [o[0] for o in full]


def test_niah_grid_runs_the_low_bit_presets_under_the_target():
    """The presets that keep evicted tokens in low-bit pages (tiered, kivi-2) answer both protocols with the
    cache at the target (its hot tier a part of it)."""
    from confkv.eval.niah import NiahConfig, full_kv_bytes, run_niah_grid
    from confkv.models import tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    config = NiahConfig(lengths=(160,), depths=(0.5,), trials=1, policies=("full", "tiered", "kivi-2"),
                        chunk=64, max_new_tokens=3, memory=0.5,
                        extra_params={"protect": 4, "page_size": 8, "group_size": 8, "kivi-2:hot_tokens": 16})
    result = run_niah_grid(model, tok, config, progress=False)
    assert {(r.policy, r.protocol) for r in result.records} == {
        (p, q) for p in ("full", "tiered", "kivi-2") for q in ("query-aware", "streaming")}
    assert result.budgets["kivi-2@160"] == {"protect": 4, "page_size": 8, "group_size": 8, "hot_tokens": 16,
                                            "memory": 0.5}
    for r in result.records:
        if r.policy != "full":
            assert 0 < r.kept_at_answer < 0.5 * 160  # the hot tier: the pages hold the rest
            if r.protocol == "streaming":
                assert r.peak_kv_bytes_per_seq <= 0.5 * full_kv_bytes(model, 160 + 3)


def test_a_page_that_takes_the_attention_comes_back_to_the_hot_tier():
    model = tiny_model("llama", seed=3)
    ids, mask = _prompt(1, 90, seed=8)
    cache = ConfKVCache.for_model(model, "confkv-r", budget=24, protect=8, bits=16, page_size=8, group_size=8,
                                  k=2, promote=0.01)
    stores = [cache.layers[i].store for i in cache.managed]
    promoted = []
    original = type(stores[0])._promote

    def spy(self, page_mass):
        before = {int(p) for p in self.old.positions[0, 0]}
        original(self, page_mass)
        after = {int(p) for p in self.old.positions[0, 0]}
        promoted.append(after - before)

    from unittest import mock
    bank = {}
    place = type(stores[0])._place_new_tokens

    def record(self, padding):  # the keys each layer received, by position
        positions = place(self, padding)
        for i, pos in enumerate(positions[0].tolist()):
            bank[(id(self), pos)] = self.recent.keys[0, :, -positions.shape[1] + i].clone()
        return positions

    with mock.patch.object(type(stores[0]), "_promote", spy), \
            mock.patch.object(type(stores[0]), "_place_new_tokens", record), torch.no_grad():
        _run(model, cache, ids, mask)
    came_back = [p for p in promoted if p]
    assert came_back, "no page was promoted at a 1% attention threshold"
    assert all(len(p) == 8 for p in came_back)  # a whole page, in head 0
    for store in stores:  # still every token in exactly one tier, the hot tier within its budget
        hot = set(store.old.positions[0, 0].tolist()) | set(store.recent.positions[0, 0].tolist())
        cold = set(store.cold.open["positions"][0, 0].tolist())
        cold |= set(store.cold.pages["positions"][0, 0, :store.cold.num_pages].flatten().tolist())
        assert not hot & cold and hot | cold == set(range(int(store.seen_real[0])))
        assert store.kept_list()[0] <= 24
        for slot, pos in enumerate(store.old.positions[0, 0].tolist()):  # bits=16: promoted keys exact
            assert torch.equal(store.old.keys[0, 0, slot], bank[(id(store), pos)][0])


def test_promotion_needs_a_policy_that_reads_attention():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="^promote:"):
        ConfKVCache.for_model(model, "quest", promote=0.2)
    with pytest.raises(ConfigError, match="^promote:"):
        make_policy("confkv-r", promote=1.5)


def test_sequences_reading_fewer_pages_read_their_best_ones():
    """Batch rows with different read budgets: each row reads its own top pages by the digest bound."""
    tier, keys = _filled_tier(tokens=40, page=4, loud=29)
    # two sequences holding the same tokens
    tier.open = {n: t.expand(2, *t.shape[1:]).clone() for n, t in tier.open.items()}
    tier.pages = {n: t.expand(2, *t.shape[1:]).clone() for n, t in tier.pages.items()}
    query = torch.zeros(2, 2, 1, 16)
    query[:, :, 0] = keys[0, :, 29] * 50
    for reads in ([1, 10], [1, 3]):
        (segment,) = tier.segments(query, torch.tensor(reads))
        visible = segment.visible.reshape(2, 2, -1, 4)[..., 0]  # [B, H, K]: which read pages count
        assert visible.sum(-1).tolist() == [[1, 1], [reads[1]] * 2]
        first = visible[0, 0].nonzero()[0, 0]
        torch.testing.assert_close(segment.keys[0, 0, 4 * first + 1], keys[0, 0, 29])  # row 0's one page: the best


def test_a_clone_of_an_offloaded_cache_runs_on_its_own(tmp_path):
    model = tiny_model("llama", seed=3)
    ids, mask = _prompt(1, 60, seed=9)
    cache = ConfKVCache.for_model(model, "confkv-r", budget=24, protect=8, bits=4, page_size=8, group_size=8, k=2,
                                  offload=True, offload_dir=str(tmp_path))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        twin = cache.clone()
        step = ids[:, -1:]
        original = model(step, cache=cache, use_cache=True).logits
        copied = model(step, cache=twin, use_cache=True).logits
    torch.testing.assert_close(copied, original)
    assert twin.kv_bytes() == cache.kv_bytes()


def test_niah_grid_with_an_offloaded_ladder_counts_the_page_file_in_the_target(tmp_path):
    """``tiered:offload=true``: sealed pages go to the page file; the target counts every tier, so the
    cache holds the same bytes as in RAM, fewer of them resident."""
    from confkv.eval.niah import NiahConfig, full_kv_bytes, run_niah_grid
    from confkv.models import tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    extra = {"protect": 4, "page_size": 8, "group_size": 8}
    records = {}
    for offload in (False, True):
        config = NiahConfig(lengths=(160,), depths=(0.5,), trials=1, policies=("tiered",), protocols=("streaming",),
                            chunk=64, max_new_tokens=3, memory=0.5,
                            extra_params={**extra, "offload": offload, "offload_dir": str(tmp_path)})
        (records[offload],) = run_niah_grid(model, tok, config, progress=False).records
        assert records[offload].peak_kv_bytes_per_seq <= 0.5 * full_kv_bytes(model, 160 + 3)
    assert records[True].peak_kv_bytes_per_seq == records[False].peak_kv_bytes_per_seq
    assert records[True].peak_resident_bytes_per_seq < records[False].peak_resident_bytes_per_seq
    assert records[False].peak_resident_bytes_per_seq == records[False].peak_kv_bytes_per_seq
    assert os.listdir(tmp_path) == []  # the page file is gone with its cache
