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
from confkv.attention import KVSegment
from confkv.attention.segments import PagedSegment
from confkv import profiling
from confkv.tiers.page_file import PageFile


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


# ---------------------------------------------------------------------------------------------------
# The cold tier of :mod:`confkv.tiers.cold` on tiny tiers whose contents are written out by hand.
#
# Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md): a read page taken
# back (:meth:`ColdTier.take_best_read_page`, dequantized at 16, 8 and 4 bits), the bookkeeping
# byte count, batch selection and clones (in RAM and offloaded). Expectations are the demoted
# tokens themselves, KIVI's half-step error bound and byte counts worked out from shapes.



PAGE = 4
DIM = 8


def _tier(bits=16, batch=1, heads=2, tokens=12, seed=0, page_file=None, **extra):
    """A tier holding ``tokens`` demoted tokens (pages of 4, head_dim 8), and its keys, values [B, H, T, D]."""
    gen = torch.Generator().manual_seed(seed)
    offload = page_file is not None
    tier = ColdTier(ColdConfig(bits=bits, page_size=PAGE, group_size=PAGE, k_high=2, k_low=2, offload=offload,
                               **extra), page_file)
    keys = torch.randn(batch, heads, tokens, DIM, generator=gen)
    values = torch.randn(batch, heads, tokens, DIM, generator=gen)
    positions = torch.arange(tokens).expand(batch, heads, tokens).clone()
    tier.demote(keys, values, positions, torch.ones(batch, tokens, dtype=torch.bool))
    return tier, keys, values


def _read_all(tier: ColdTier) -> None:
    """A read of every page (no ranking: pages 0..N-1 in order, in every head)."""
    batch = tier.open["keys"].shape[0]
    tier.segments(torch.zeros(batch, tier.open["keys"].shape[1], 1, DIM), torch.full((batch,), tier.num_pages))


def _mass(batch, heads, pages, hot):
    """[B, H, N * P] attention mass: 0.125 on each slot of page ``hot[h]`` (0.5 a page), 0.01 elsewhere."""
    mass = torch.full((batch, heads, pages, PAGE), 0.01)
    for head, page in enumerate(hot):
        mass[:, head, page] = 0.125
    return mass.reshape(batch, heads, pages * PAGE)


def _page_positions(tier: ColdTier, row=0) -> list[list[list[int]]]:
    return tier.pages["positions"][row, :, :tier.num_pages].tolist()


# ------------------------------------------------------------------ take_best_read_page / _dequantized

@pytest.mark.parametrize("bits", [16, 8, 4])
def test_taken_page_holds_the_demoted_tokens_of_each_heads_hottest_page(bits):
    tier, keys, values = _tier(bits=bits, tokens=12)  # 3 pages of 4 tokens, no open page
    _read_all(tier)
    mass = _mass(1, 2, 3, hot=[1, 2])  # head 0's hottest page: tokens 4..7; head 1's: tokens 8..11
    mass[0, 0, 4:8] = torch.tensor([0.25, 0.125, 0.0625, 0.0625])  # still 0.5 on page 1
    taken = tier.take_best_read_page(mass, threshold=0.5)
    assert taken is not None
    assert taken["positions"].tolist() == [[[4, 5, 6, 7], [8, 9, 10, 11]]]
    assert taken["valid"].tolist() == [[True] * 4]
    assert taken["mass"].dtype == torch.float32
    assert taken["mass"].tolist() == [[[0.25, 0.125, 0.0625, 0.0625], [0.125] * 4]]
    want_keys = torch.stack([keys[0, 0, 4:8], keys[0, 1, 8:12]])[None]  # [1, 2, 4, 8]
    want_values = torch.stack([values[0, 0, 4:8], values[0, 1, 8:12]])[None]
    assert taken["keys"].shape == (1, 2, PAGE, DIM) and taken["values"].shape == (1, 2, PAGE, DIM)
    if bits == 16:
        assert torch.equal(taken["keys"], want_keys) and torch.equal(taken["values"], want_values)
    else:
        levels = (1 << bits) - 1
        # KIVI: keys per channel over the page's 4 tokens, values per token over groups of 4 channels;
        # the error is at most half a step (range / levels) plus float16 rounding of scale and minimum
        key_range = want_keys.amax(2, keepdim=True) - want_keys.amin(2, keepdim=True)
        grouped = want_values.reshape(1, 2, PAGE, DIM // PAGE, PAGE)
        value_range = (grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)).expand_as(grouped)
        value_range = value_range.reshape(1, 2, PAGE, DIM)
        assert ((taken["keys"] - want_keys).abs() <= key_range / levels / 2 + 1e-2).all()
        assert ((taken["values"] - want_values).abs() <= value_range / levels / 2 + 1e-2).all()
    # the page left every head; the others stay in their order
    assert tier.num_pages == 2
    assert _page_positions(tier) == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[0, 1, 2, 3], [4, 5, 6, 7]]]


def test_a_page_exactly_at_the_threshold_is_taken_and_one_below_is_not():
    tier, _, _ = _tier(tokens=12)
    _read_all(tier)
    assert tier.take_best_read_page(_mass(1, 2, 3, hot=[2, 0]), threshold=0.5 + 1e-6) is None
    assert tier.num_pages == 3  # nothing taken
    taken = tier.take_best_read_page(_mass(1, 2, 3, hot=[2, 0]), threshold=0.5)  # 4 x 0.125 = 0.5 exactly
    assert taken["positions"].tolist() == [[[8, 9, 10, 11], [0, 1, 2, 3]]]
    assert _page_positions(tier) == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[4, 5, 6, 7], [8, 9, 10, 11]]]


def test_one_hot_head_is_enough_and_each_batch_row_takes_its_own_page():
    tier, _, _ = _tier(batch=2, heads=2, tokens=12)
    _read_all(tier)
    mass = torch.full((2, 2, 3, PAGE), 0.01)
    mass[0, 0, 2] = 0.2  # row 0: head 0 hot on page 2, head 1 cold but still best on page 1
    mass[0, 1, 1] = 0.02
    mass[1, 0, 0] = 0.02  # row 1: both heads below the threshold (best pages 0 and 2)
    mass[1, 1, 2] = 0.02
    taken = tier.take_best_read_page(mass.reshape(2, 2, 12), threshold=0.5)
    assert taken["positions"].tolist() == [[[8, 9, 10, 11], [4, 5, 6, 7]], [[0, 1, 2, 3], [8, 9, 10, 11]]]
    assert _page_positions(tier, 0) == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1, 2, 3], [8, 9, 10, 11]]]
    assert _page_positions(tier, 1) == [[[4, 5, 6, 7], [8, 9, 10, 11]], [[0, 1, 2, 3], [4, 5, 6, 7]]]


def _ragged_tier(heads):
    """Two sequences: row 0 demotes 8 tokens, row 1 only 2 then 4: its page 0 holds 2 valid slots."""
    tier = ColdTier(ColdConfig(bits=16, page_size=PAGE, group_size=PAGE, k_high=2, k_low=2))
    keys = torch.randn(2, heads, 4, DIM, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(8).reshape(2, 4)[:, None].expand(2, heads, 4).clone()
    tier.demote(keys, keys, positions[..., :4], torch.tensor([[True] * 4, [True, True, False, False]]))
    tier.demote(keys, keys, positions + 4, torch.ones(2, 4, dtype=torch.bool))
    assert tier.num_pages == 2 and tier.pages["valid"][1, 0, 0].tolist() == [True, True, False, False]
    return tier


def test_pages_with_different_valid_slots_per_head_are_not_taken():
    tier = _ragged_tier(heads=2)
    _read_all(tier)
    assert tier.take_best_read_page(_mass(2, 2, 2, hot=[0, 1]), threshold=0.1) is None  # row 1: 2 vs 4 slots
    assert tier.num_pages == 2
    taken = tier.take_best_read_page(_mass(2, 2, 2, hot=[0, 0]), threshold=0.1)
    assert taken["valid"].tolist() == [[True] * 4, [True, True, False, False]]
    assert tier.num_pages == 1


def test_one_head_tier_returns_its_page_validity():
    tier = _ragged_tier(heads=1)
    _read_all(tier)
    taken = tier.take_best_read_page(_mass(2, 1, 2, hot=[0]), threshold=0.1)
    assert taken["valid"].tolist() == [[True] * 4, [True, True, False, False]]
    assert taken["positions"][:, 0, :2].tolist() == [[0, 1], [4, 5]]


def test_after_a_take_the_read_is_spent_observe_and_take_do_nothing():
    tier, _, _ = _tier(tokens=12)
    _read_all(tier)
    assert tier.take_best_read_page(_mass(1, 2, 3, hot=[0, 0]), threshold=0.5) is not None
    heat = tier.pages["heat"].clone()
    tier.observe(_mass(1, 2, 3, hot=[0, 0]))
    assert torch.equal(tier.pages["heat"], heat)
    assert tier.take_best_read_page(_mass(1, 2, 3, hot=[0, 0]), threshold=0.5) is None
    assert tier.num_pages == 2


def test_taking_pages_keeps_the_rest_in_order_across_many_pages():
    tier, _, _ = _tier(heads=1, tokens=40 * PAGE)  # 40 pages
    _read_all(tier)
    taken = tier.take_best_read_page(_mass(1, 1, 40, hot=[17]), threshold=0.5)
    assert taken["positions"][0, 0].tolist() == list(range(68, 72))
    starts = [row[0] for row in _page_positions(tier)[0]]
    assert starts == [4 * p for p in range(40) if p != 17]


# ------------------------------------------------------------------ demotion

def test_a_group_size_that_does_not_divide_head_dim_is_refused_by_name():
    tier = ColdTier(ColdConfig(bits=8, page_size=16, group_size=8, k_high=1, k_low=1))
    keys = torch.zeros(1, 1, 2, 12)
    with pytest.raises(ValueError, match=r"^group_size: must divide head_dim=12 .*got 8$"):
        tier.demote(keys, keys, torch.zeros(1, 1, 2, dtype=torch.int64), torch.ones(1, 2, dtype=torch.bool))


def test_later_tokens_are_stored_in_the_dtype_of_the_first():
    tier = ColdTier(ColdConfig(bits=16, page_size=PAGE, group_size=PAGE, k_high=1, k_low=1))
    first = torch.full((1, 1, 1, DIM), 0.5, dtype=torch.float16)
    tier.demote(first, first, torch.zeros(1, 1, 1, dtype=torch.int64), torch.ones(1, 1, dtype=torch.bool))
    later = torch.full((1, 1, 1, DIM), 0.25, dtype=torch.float32)
    tier.demote(later, later * 2, torch.ones(1, 1, 1, dtype=torch.int64), torch.ones(1, 1, dtype=torch.bool))
    assert tier.open["keys"].dtype == tier.open["values"].dtype == torch.float16
    assert tier.open["keys"][0, 0, :, 0].tolist() == [0.5, 0.25] and tier.open["values"][0, 0, :, 0].tolist() == [0.5, 0.5]
    assert tier.kv_bytes() == 2 * (2 * DIM * 2)


def test_demoted_valid_slots_move_to_the_front_in_order_and_empty_slots_are_dropped():
    tier = ColdTier(ColdConfig(bits=16, page_size=64, group_size=64, k_high=1, k_low=1))
    keys = torch.arange(80.0).reshape(2, 1, 40, 1).expand(2, 1, 40, DIM)
    positions = torch.arange(40).expand(2, 1, 40).clone()
    valid = torch.zeros(2, 40, dtype=torch.bool)
    valid[0, ::2] = True  # row 0: the 20 even slots
    valid[1, :5] = True  # row 1: the first 5
    tier.demote(keys, keys, positions, valid)
    assert tier.open_length == 20  # the most valid slots of a row; the rest are empty in every row
    assert tier.open["positions"][0, 0].tolist() == list(range(0, 40, 2))
    assert tier.open["keys"][0, 0, :, 0].tolist() == [float(p) for p in range(0, 40, 2)]
    assert tier.open["positions"][1, 0, :5].tolist() == [0, 1, 2, 3, 4]
    assert tier.open["valid"].tolist() == [[True] * 20, [True] * 5 + [False] * 15]
    assert tier.token_count().tolist() == [20, 5]


# ------------------------------------------------------------------ sizes

@pytest.mark.parametrize("bits, dtype, k, page_bytes, digest", [
    # H=2, P=4, D=8; digest: min and max, float16, per head and channel = 2*2*8*2 = 64
    (16, torch.float32, 2, 2 * 2 * 4 * 8 * 4 + 64, 64),  # keys and values in the model's dtype
    (16, torch.float16, 2, 2 * 2 * 4 * 8 * 2 + 64, 64),
    # codes 2*H*P*D*bits/8; key scale+min per channel and group of 4 tokens 2*H*1*8*2 = 64;
    # value scale+min per token and group of 4 channels 2*H*4*2*2 = 64
    (8, torch.float32, 2, 128 + 64 + 64 + 64, 64),
    (4, torch.bfloat16, 2, 64 + 64 + 64 + 64, 64),
    (8, torch.float32, ALL_PAGES, 128 + 64 + 64, 0),  # every page read: no digest
])
def test_byte_counts_of_pages_and_tier_by_hand(bits, dtype, k, page_bytes, digest, tmp_path):
    config = ColdConfig(bits=bits, page_size=PAGE, group_size=PAGE, k_high=k, k_low=k)
    empty = ColdTier(config)
    assert empty.kv_bytes() == 0 and empty.offloaded_bytes() == 0
    keys = torch.randn(3, 2, 10, DIM).to(dtype)  # B=3, H=2
    positions = torch.arange(10).expand(3, 2, 10).clone()
    tier = ColdTier(config)
    tier.demote(keys, keys, positions, torch.ones(3, 10, dtype=torch.bool))  # 2 pages + 2 open tokens a row
    assert tier.page_nbytes() == page_bytes
    assert tier._digest_nbytes() == digest
    element = torch.empty((), dtype=dtype).element_size()
    assert tier.kv_bytes() == 2 * (3 * 2 * 2 * DIM * element) + 3 * 2 * page_bytes
    assert tier.offloaded_bytes() == 0  # in RAM
    page_file = PageFile(str(tmp_path))
    try:
        offloaded = ColdTier(ColdConfig(bits=bits, page_size=PAGE, group_size=PAGE, k_high=k, k_low=k, offload=True),
                             page_file)
        offloaded.demote(keys, keys, positions, torch.ones(3, 10, dtype=torch.bool))
        assert offloaded.offloaded_bytes() == 3 * 2 * (page_bytes - digest)  # digests stay resident
        assert offloaded.kv_bytes() == tier.kv_bytes()
    finally:
        page_file.close()


def test_a_fresh_tier_has_read_nothing():
    tier = ColdTier(ColdConfig(bits=4, page_size=PAGE, group_size=PAGE, k_high=2, k_low=2))
    assert tier.bytes_read == 0 and tier.reads == 0 and tier.num_pages == 0
    assert tier.segments(torch.zeros(1, 2, 1, DIM), torch.tensor([2])) == []  # nothing demoted yet
    assert tier.bytes_read == 0 and tier.reads == 1
    fresh, _, _ = _tier(tokens=12)  # 3 pages, never read: no attention to add, no page to take
    heat = fresh.pages["heat"].clone()
    fresh.observe(_mass(1, 2, 3, hot=[0, 1]))
    assert torch.equal(fresh.pages["heat"], heat)
    assert fresh.take_best_read_page(_mass(1, 2, 3, hot=[0, 1]), threshold=0.1) is None and fresh.num_pages == 3


def test_token_count_adds_open_and_sealed_valid_tokens_per_row():
    assert ColdTier(ColdConfig(bits=16, page_size=PAGE, group_size=PAGE, k_high=2, k_low=2)).token_count() is None
    tier = _ragged_tier(heads=1)
    assert tier.token_count().tolist() == [8, 6]
    one = torch.zeros(2, 1, 2, DIM)
    tier.demote(one, one, torch.zeros(2, 1, 2, dtype=torch.int64), torch.tensor([[True, True], [True, False]]))
    assert tier.open_length == 2 and tier.token_count().tolist() == [10, 7]


def test_page_storage_doubles_when_full_so_the_page_file_holds_twice_the_pages(tmp_path):
    page_file = PageFile(str(tmp_path))
    try:
        tier, _, _ = _tier(bits=8, heads=1, tokens=7 * PAGE, page_file=page_file)  # 7 pages in one go
        assert tier.pages["valid"].shape[2] == 8  # at least 8 pages of room
        per_page = 4 * 8 + 8 * 2 + 8 * 2 + 4 * 8 + 4 * 2 * 2 + 4 * 2 * 2  # codes, scales, minima (B=H=1)
        assert page_file.live_bytes == 8 * per_page
        for pages, capacity in ((8, 8), (9, 16), (10, 16)):  # the 8th page fits; the 9th doubles the storage
            one = torch.zeros(1, 1, PAGE, DIM)
            tier.demote(one, one, torch.zeros(1, 1, PAGE, dtype=torch.int64), torch.ones(1, PAGE, dtype=torch.bool))
            assert tier.num_pages == pages and tier.pages["valid"].shape[2] == capacity
            assert page_file.live_bytes == capacity * per_page
        assert tier.token_count().tolist() == [10 * PAGE]
    finally:
        page_file.close()


# ------------------------------------------------------------------ reading the open page

def test_open_page_slots_a_sequence_lacks_are_invisible_to_its_queries():
    tier = ColdTier(ColdConfig(bits=4, page_size=PAGE, group_size=PAGE, k_high=2, k_low=2))
    keys = torch.randn(2, 2, 2, DIM, generator=torch.Generator().manual_seed(5))
    tier.demote(keys, keys, torch.zeros(2, 2, 2, dtype=torch.int64), torch.tensor([[True, True], [True, False]]))
    (segment,) = tier.segments(torch.zeros(2, 2, 1, DIM), torch.tensor([2, 2]))  # no page sealed yet
    assert torch.equal(segment.keys, keys)
    assert segment.visible.shape == (2, 1, 1, 2)  # broadcast over heads and queries
    assert segment.visible[:, 0, 0].tolist() == [[True, True], [True, False]]
    full = ColdTier(ColdConfig(bits=4, page_size=PAGE, group_size=PAGE, k_high=2, k_low=2))
    full.demote(keys, keys, torch.zeros(2, 2, 2, dtype=torch.int64), torch.ones(2, 2, dtype=torch.bool))
    assert full.segments(torch.zeros(2, 2, 1, DIM), torch.tensor([2, 2]))[0].visible is None


def test_bytes_read_by_hand_open_page_digests_and_read_pages():
    tier, _, _ = _tier(bits=16, tokens=14)  # B=1, H=2: 3 pages of 576 bytes (512 data + 64 digest), 2 open
    query = torch.zeros(1, 2, 1, DIM)
    open_bytes = 2 * (2 * 2 * DIM * 4)  # keys and values [1, 2, 2, 8] float32
    tier.segments(query, torch.tensor([0]))
    assert tier.bytes_read == open_bytes
    tier.segments(query, torch.tensor([3]))  # every page: no ranking, no digest read
    assert tier.bytes_read == open_bytes + 3 * 512
    tier.segments(query, torch.tensor([1]))  # ranking reads all 3 digests, then one page
    assert tier.bytes_read == open_bytes + 3 * 64 + 512


def test_paged_read_hands_over_the_pages_and_dense_read_gathers_them():
    tier, keys, _ = _tier(bits=16, tokens=14)
    query = torch.zeros(1, 2, 1, DIM)
    open_segment, pages = tier.segments(query, torch.tensor([3]), paged=True)
    assert isinstance(pages, PagedSegment) and isinstance(open_segment, KVSegment)
    assert pages.index.tolist() == [[[0, 1, 2], [0, 1, 2]]]
    _, dense = tier.segments(query, torch.tensor([3]))
    assert isinstance(dense, KVSegment)
    assert torch.equal(dense.keys, keys[:, :, :12])


def test_the_page_ranking_and_the_gather_are_timed_as_their_own_sections():
    tier, _, _ = _tier(bits=4, tokens=14)
    timers = profiling.Timers()
    with profiling.enabled(timers):
        tier.segments(torch.zeros(1, 2, 1, DIM), torch.tensor([1]))  # ranks the 3 pages, gathers one
        tier.segments(torch.zeros(1, 2, 1, DIM), torch.tensor([3]), paged=True)  # no ranking, no gather
    assert dict(timers.calls) == {"cold page selection (digest bound + top-k)": 1, "cold pages (gather + dequantize)": 1}


def test_digest_bound_is_quests_sum_of_per_channel_maxima():
    """sum_d max(q_d min_d, q_d max_d) per page, largest over a KV head's query heads and queries."""
    gen = torch.Generator().manual_seed(11)
    keys = torch.randint(-8, 9, (1, 2, 12, DIM), generator=gen) / 4  # exact in float16
    tier = ColdTier(ColdConfig(bits=4, page_size=PAGE, group_size=PAGE, k_high=1, k_low=1))
    tier.demote(keys, keys, torch.zeros(1, 2, 12, dtype=torch.int64), torch.ones(1, 12, dtype=torch.bool))
    query = torch.randint(-6, 7, (1, 4, 3, DIM), generator=gen) / 8  # GQA: query heads 0, 1 -> KV head 0
    bound = tier.digest_bound(query)
    assert bound.shape == (1, 2, 3) and bound.dtype == torch.float32
    for head in range(2):
        for page in range(3):
            block = keys[0, head, 4 * page:4 * page + 4]
            low, high = block.amin(0).tolist(), block.amax(0).tolist()
            want = max(sum(max(q * lo, q * hi) for q, lo, hi in zip(row.tolist(), low, high))
                       for q_head in (2 * head, 2 * head + 1) for row in query[0, q_head])
            assert bound[0, head, page].item() == pytest.approx(want, abs=1e-5)


def test_an_empty_batch_reads_only_its_open_page():
    tier = ColdTier(ColdConfig(bits=16, page_size=PAGE, group_size=PAGE, k_high=1, k_low=1))
    empty = torch.zeros(0, 2, 6, DIM)
    tier.demote(empty, empty, torch.zeros(0, 2, 6, dtype=torch.int64), torch.ones(0, 6, dtype=torch.bool))
    assert tier.num_pages == 1 and tier.open_length == 2
    segments = tier.segments(torch.zeros(0, 2, 1, DIM), torch.zeros(0, dtype=torch.int64))
    assert len(segments) == 1 and segments[0].keys.shape == (0, 2, 2, DIM) and tier.bytes_read == 0


# ------------------------------------------------------------------ cold budget

def _budget_tier(budget, tokens, heads=1):
    tier = ColdTier(ColdConfig(bits=16, page_size=PAGE, group_size=PAGE, k_high=1, k_low=1, cold_budget=budget))
    keys = torch.zeros(1, heads, tokens, DIM)
    tier.demote(keys, keys, torch.arange(tokens).expand(1, heads, tokens).clone(), torch.ones(1, tokens, dtype=torch.bool))
    return tier


def test_cold_budget_counts_the_open_page_against_the_sealed_pages():
    tier = _budget_tier(12, 14)  # 3 pages + 2 open tokens: (12 - 2) // 4 = 2 pages stay, the newest (none read)
    assert tier.num_pages == 2 and tier.open_length == 2
    assert [row[0] for row in _page_positions(tier)[0]] == [4, 8]
    assert tier.token_count().tolist() == [10]
    exact = _budget_tier(12, 12)  # 3 pages, no open token: exactly the budget, all stay
    assert [row[0] for row in _page_positions(exact)[0]] == [0, 4, 8]


def test_a_budget_of_one_page_with_open_tokens_keeps_no_sealed_page():
    tier = _budget_tier(PAGE, 6)  # 1 page + 2 open tokens: (4 - 2) // 4 = 0 pages
    assert tier.num_pages == 0 and tier.token_count().tolist() == [2]
    assert tier.open["positions"][0, 0].tolist() == [4, 5]


def test_among_many_equally_cold_pages_the_oldest_are_evicted_first():
    tier = _budget_tier(20 * PAGE, 40 * PAGE, heads=2)  # 40 unread pages (equal heat), 20 may stay
    assert [row[0] for row in _page_positions(tier)[1]] == [4 * p for p in range(20, 40)]
    _read_all(tier)
    tier.observe(torch.zeros(1, 2, 20 * PAGE))  # read once, no attention: all equal at heat 0
    more = torch.zeros(1, 2, 10 * PAGE, DIM)
    tier.demote(more, more, torch.arange(160, 200).expand(1, 2, 40).clone(), torch.ones(1, 40, dtype=torch.bool))
    # 30 pages: the 10 new ones (unread) stay, and of the 20 equally cold read ones the newest 10
    assert [row[0] for row in _page_positions(tier)[0]] == [120 + 4 * p for p in range(10)] + [160 + 4 * p for p in range(10)]


# ------------------------------------------------------------------ bookkeeping_bytes

def test_bookkeeping_bytes_count_positions_validity_heat_clock_and_attention_of_used_pages():
    assert ColdTier(ColdConfig(bits=16, page_size=PAGE, group_size=PAGE, k_high=2, k_low=2)).bookkeeping_bytes() == 0
    tier, _, _ = _tier(bits=8, tokens=10)  # B=1, H=2: 2 sealed pages (capacity 8) and 2 open tokens
    # open: positions 1*2*2 int64 = 32, valid 1*2 bool = 2, attention while hot 1*2*2 float32 = 16
    # per page: positions 2*4 int64 = 64, valid 2*4 bool = 8, heat 2 float32 = 8, sealed_at 2 int64 = 16,
    # confidence at sealing 2 float32 = 8, attention while hot 2 float32 = 8
    got = tier.bookkeeping_bytes()
    assert type(got) is int
    assert got == 32 + 2 + 16 + 2 * (64 + 8 + 8 + 16 + 8 + 8)
    tier.demote(*(torch.zeros(1, 2, 3, DIM),) * 2, torch.zeros(1, 2, 3, dtype=torch.int64),
                torch.ones(1, 3, dtype=torch.bool))  # 5 open tokens: one more page, 1 open
    assert tier.num_pages == 3
    assert tier.bookkeeping_bytes() == 16 + 1 + 8 + 3 * (64 + 8 + 8 + 16 + 8 + 8)


# ------------------------------------------------------------------ select_batch

def test_select_batch_keeps_the_chosen_rows_of_open_and_sealed_tokens():
    tier, keys, _ = _tier(batch=3, heads=2, tokens=6)  # 1 page + 2 open tokens per row
    tier.pages["positions"][:, :, 0] += torch.tensor([0, 100, 200])[:, None, None]  # rows told apart
    tier.open["positions"] += torch.tensor([0, 100, 200])[:, None, None]
    tier.select_batch(torch.tensor([2, 0]))
    assert tier.open["positions"][:, 0].tolist() == [[204, 205], [4, 5]]
    assert torch.equal(tier.open["keys"], keys[[2, 0]][:, :, 4:])
    assert tier.open["valid"].shape == (2, 2)
    assert tier.pages["positions"][:, 0, 0].tolist() == [[200, 201, 202, 203], [0, 1, 2, 3]]
    assert torch.equal(tier.pages["keys"][:, :, 0], keys[[2, 0]][:, :, :4])
    assert all(t.shape[:2] == (2, 2) for t in tier.pages.values())
    assert tier.token_count().tolist() == [6, 6]


def test_select_batch_of_an_empty_tier_does_nothing():
    tier = ColdTier(ColdConfig(bits=16, page_size=PAGE, group_size=PAGE, k_high=2, k_low=2))
    tier.select_batch(torch.tensor([0]))
    assert tier.open is None and tier.pages == {} and tier.token_count() is None


# ------------------------------------------------------------------ clone

def test_a_clone_holds_the_same_tokens_and_lives_on_its_own():
    empty = ColdTier(ColdConfig(bits=16, page_size=PAGE, group_size=PAGE, k_high=2, k_low=2)).clone()
    assert empty.open is None and empty.pages == {} and empty.num_pages == 0
    tier, keys, _ = _tier(bits=4, tokens=10)
    _read_all(tier)
    twin = tier.clone()
    assert twin.config is tier.config and twin.page_file is None
    assert twin.num_pages == 2 and twin.reads == 1 and twin.head_dim == DIM and twin.dtype == torch.float32
    assert sorted(twin.open) == sorted(tier.open) and sorted(twin.pages) == sorted(tier.pages)
    for name in tier.open:
        assert torch.equal(twin.open[name], tier.open[name])
    for name in tier.pages:
        assert torch.equal(twin.pages[name], tier.pages[name])
    # the twin demotes on its own: one more page there, none here
    more = torch.zeros(1, 2, 2, DIM)
    twin.demote(more, more, torch.full((1, 2, 2), 99), torch.ones(1, 2, dtype=torch.bool))
    assert twin.num_pages == 3 and tier.num_pages == 2 and tier.open_length == 2
    assert twin.pages["positions"][0, 0, 2].tolist() == [8, 9, 99, 99]
    assert torch.equal(tier.open["keys"], keys[:, :, 8:])


def test_a_clone_of_an_offloaded_tier_puts_only_its_page_data_in_the_page_file(tmp_path):
    page_file = PageFile(str(tmp_path))
    try:
        tier, _, _ = _tier(bits=8, tokens=10, page_file=page_file)
        before = page_file.live_bytes
        twin = tier.clone()
        assert twin.page_file is page_file and twin.config is tier.config
        # capacity 8 pages, B=1, H=2: key/value codes 8*4*8 uint8 = 256 bytes a head, scales and minima
        # 8*(1*8 | 4*2) float16 = 128 bytes a head each; positions, validity, heat, clock, digests stay in RAM
        assert page_file.live_bytes - before == 2 * (256 + 128 + 128) * 2
        assert twin.offloaded_bytes() == tier.offloaded_bytes() > 0
        for name, tensor in twin.pages.items():
            assert torch.equal(tensor, tier.pages[name])
            assert tensor.data_ptr() != tier.pages[name].data_ptr()
    finally:
        page_file.close()


# ------------------------------------------------------------------ what a sealed page holds

@pytest.mark.parametrize("bits", [16, 4])
def test_kv_bytes_are_the_bytes_the_open_and_sealed_page_tensors_hold(bits):
    """kv_bytes() claims exact bytes: check it against the tensors themselves (open page, then
    each page tensor's share of its used pages); the digest is float16 (2 bytes a channel), as
    the module docstring and page_bytes count it, so a float32 digest would hold more."""
    tier, _, _ = _tier(bits=bits, batch=2, tokens=10)  # 2 pages + 2 open tokens a row
    assert tier.pages["digest_min"].dtype == tier.pages["digest_max"].dtype == torch.float16
    held = tier.open["keys"].nbytes + tier.open["values"].nbytes
    for name in ("keys", "values", "key_codes", "key_scale", "key_min", "value_codes", "value_scale",
                 "value_min", "digest_min", "digest_max"):
        if name in tier.pages:
            tensor = tier.pages[name]
            held += tensor.nbytes * tier.num_pages // tensor.shape[2]
    assert tier.num_pages == 2 and tier.kv_bytes() == held


def test_sealed_pages_and_their_bookkeeping_live_on_the_device_of_the_keys():
    """On the ``meta`` device (shapes only; demote's left-alignment needs real validity, so the
    pages are sealed directly): heat and seal clock are made next to the keys, as on an accelerator
    where a CPU heat would not take the read's attention mass (observe) nor rank pages there."""
    tier = ColdTier(ColdConfig(bits=4, page_size=PAGE, group_size=PAGE, k_high=1, k_low=1))
    tier.head_dim, tier.dtype = DIM, torch.float32
    tokens = {"keys": torch.empty(1, 2, 2 * PAGE, DIM, device="meta"),
              "values": torch.empty(1, 2, 2 * PAGE, DIM, device="meta"),
              "positions": torch.empty(1, 2, 2 * PAGE, dtype=torch.int64, device="meta"),
              "valid": torch.empty(1, 2 * PAGE, dtype=torch.bool, device="meta"),
              "attention": torch.empty(1, 2, 2 * PAGE, device="meta")}
    tier._seal(tokens, 2)
    assert tier.num_pages == 2
    assert {name: tensor.device.type for name, tensor in tier.pages.items()} == {name: "meta" for name in tier.pages}
    assert tier.pages["heat"].dtype == torch.float32 and tier.pages["sealed_at"].dtype == torch.int64
    bound = tier.digest_bound(torch.empty(1, 2, 1, DIM, device="meta"))
    assert bound.device.type == "meta" and bound.shape == (1, 2, 2)


def test_dropped_pages_of_an_exact_capacity_tier_leave_the_rest_in_order_and_no_spare_page():
    """A ladder's rung (``exact_capacity``: every allocated page counted) gathers the pages it keeps into its tensors:
    the rest keep their order in every head, their codes and metadata unchanged, and no page is left allocated."""
    gen = torch.Generator().manual_seed(5)
    tier = ColdTier(ColdConfig(bits=4, page_size=PAGE, group_size=PAGE, k_high=2, k_low=2))
    tier.exact_capacity = True
    keys, values = torch.randn(1, 2, 6 * PAGE, DIM, generator=gen), torch.randn(1, 2, 6 * PAGE, DIM, generator=gen)
    tier.demote(keys, values, torch.arange(6 * PAGE).expand(1, 2, 6 * PAGE).clone(), torch.ones(1, 6 * PAGE, dtype=torch.bool))
    before = {name: t.clone() for name, t in tier.pages.items()}
    tier.drop_pages(torch.tensor([[[1, 4], [5, 0]]]))  # head 0 drops pages 1 and 4, head 1 pages 5 and 0
    kept = {0: [0, 2, 3, 5], 1: [1, 2, 3, 4]}
    assert tier.num_pages == 4
    for name, tensor in tier.pages.items():
        assert tensor.shape[2] == 4, name  # no spare page allocated
        for head, pages in kept.items():
            assert torch.equal(tensor[0, head], before[name][0, head, pages]), (name, head)
    assert tier.pages["positions"][0, :, :, 0].tolist() == [[0, 8, 12, 20], [4, 8, 12, 16]]


@pytest.mark.parametrize("bits", [16, 4])
def test_a_tier_of_exact_capacity_holds_the_pages_a_growing_tier_holds_in_the_order_they_came(bits):
    """A ladder's rung keeps no spare page (``exact_capacity``: each page added joins the tensors in one cat); its
    pages, metadata and order (sealed, then put from another tier, then sealed again) are a doubling tier's, byte for
    byte: the order is the seal order that breaks ties between unread pages."""
    def demote(tier: ColdTier, tokens: int, start: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        tier.demote(torch.randn(2, 2, tokens, DIM, generator=gen), torch.randn(2, 2, tokens, DIM, generator=gen),
                    (start + torch.arange(tokens)).expand(2, 2, tokens).clone(), torch.ones(2, tokens, dtype=torch.bool))

    def filled(exact: bool) -> ColdTier:
        tier = ColdTier(ColdConfig(bits=bits, page_size=PAGE, group_size=PAGE, k_high=2, k_low=2))
        tier.exact_capacity = exact
        demote(tier, PAGE, 0, seed=4)
        demote(tier, 2 * PAGE, PAGE, seed=5)  # a page at a time, then two at once
        source, _, _ = _tier(bits=bits, batch=2, tokens=3 * PAGE, seed=5)
        tier.put_pages(source.take_pages(torch.tensor([[[2, 0], [1, 2]], [[0, 1], [2, 1]]])), torch.float32)
        demote(tier, PAGE, 100, seed=6)
        return tier

    exact, doubling = filled(True), filled(False)
    assert exact.num_pages == doubling.num_pages == 6
    assert all(t.shape[2] == 6 for t in exact.pages.values()) and doubling.pages["valid"].shape[2] == 8
    for name, tensor in exact.pages.items():
        assert torch.equal(tensor, doubling.pages[name].narrow(2, 0, 6)), name
    first = exact.pages["positions"][..., 0]  # each page's first position: seals, the pages put, a seal again
    assert first[0, 0].tolist() == [0, 4, 8, 8, 0, 100] and first[1, 1].tolist() == [0, 4, 8, 8, 4, 100]
