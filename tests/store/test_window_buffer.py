"""The FP window's preallocated buffer (confkv/store/window_buffer.py) and the store's in-place decode step
(LayerStore.decode_step): the same state and output as append + attend, its spare bytes counted."""

import dataclasses

import pytest
import torch

from confkv import native
from confkv.config import StoreConfig
from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LeanDecoder
from confkv.models import tiny_model
from confkv.store.hot_tier import Region
from confkv.native.decode import DecodePlan
from confkv.store.window_buffer import WindowBuffer
from thread_counts import torch_threads

# spare slots (new_empty) and other buffers to be overwritten start as NaN / the lowest integer / True
pytestmark = pytest.mark.usefixtures("nan_filled_empty")

# attention-ranked policies (the in-place path needs the mass); budgets small enough to evict
RANKED = [
    ("h2o", {"budget": 20, "protect": 4}),
    ("tova", {"budget": 20, "protect": 4}),
    ("confkv", {"n_high": 16, "n_low": 28, "tau": 0.02, "protect": 4}),
    ("scissorhands", {"budget": 20, "protect": 4}),
]


def _region(length: int, seed: int = 0, stats: tuple[str, ...] = ("ema",), dim: int = 8) -> Region:
    """B 2, Hkv 3, ``dim`` channels, every slot valid, each statistic random in [0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    return Region(keys=torch.randn(2, 3, length, dim, generator=gen), values=torch.randn(2, 3, length, dim, generator=gen),
                  positions=torch.arange(length).expand(2, 3, length).clone(), valid=torch.ones(2, length, dtype=torch.bool),
                  stats={name: torch.rand(2, 3, length, generator=gen) for name in stats}, all_valid=True)


def test_a_buffer_holds_the_region_and_appends_in_place():
    region = _region(5)
    buffer = WindowBuffer.around(region, 7)
    assert buffer.capacity == 7 and not buffer.backs(region)  # a copy, not the region's own tensors
    grown = buffer.append_one(5, torch.ones(2, 3, 1, 8), torch.full((2, 3, 1, 8), 2.0), torch.tensor([40, 41]))
    assert buffer.backs(grown) and grown.length == 6 and grown.all_valid
    assert torch.equal(grown.keys[:, :, :5], region.keys) and torch.equal(grown.stats["ema"][:, :, :5], region.stats["ema"])
    assert torch.equal(grown.keys[:, :, 5], torch.ones(2, 3, 8)) and torch.equal(grown.values[:, :, 5], torch.full((2, 3, 8), 2.0))
    assert grown.positions[:, :, 5].tolist() == [[40] * 3, [41] * 3] and bool(grown.valid[:, 5].all())
    assert float(grown.stats["ema"][:, :, 5].abs().sum()) == 0.0
    again = buffer.append_one(6, torch.zeros(2, 3, 1, 8), torch.zeros(2, 3, 1, 8), torch.tensor([42, 43]))
    assert buffer.backs(again) and again.length == 7 and torch.equal(again.keys[:, :, 5], grown.keys[:, :, 5])
    assert buffer.nbytes() == 2 * 2 * 3 * 7 * 8 * 4
    assert not buffer.backs(again.slice(0, 7, copy=True))
    assert not buffer.backs(grown)  # the same storage, but no longer the views append_one returned last
    again.keys = again.keys.clone()  # the last views, one of them replaced by a copy
    assert not buffer.backs(again)


def test_a_buffer_refuses_too_little_room_and_int8_regions():
    with pytest.raises(ValueError, match="^a window buffer of 4 slots cannot hold a region of 5$"):
        WindowBuffer.around(_region(5), 4)
    exact = WindowBuffer.around(_region(5), 5)  # as many slots as the region: taken, and full
    assert exact.capacity == 5 and torch.equal(exact.keys, _region(5).keys)
    region = _region(5)
    region.key_scale = region.value_scale = torch.ones(2, 3, 5)
    with pytest.raises(ValueError, match="^a window buffer holds a full-precision region, not an INT8 one$"):
        WindowBuffer.around(region, 8)


def _decode_both(name, params, store, steps=30, prompt=24, asymmetric=False):
    """The same tokens through the lean decoder (decode_step) and model(...) (append + attend)."""
    model = tiny_model("llama", asymmetric=asymmetric)
    ids = torch.randint(1, 250, (2, prompt + steps), generator=torch.Generator().manual_seed(1))
    caches = [ConfKVCache.for_model(model, name, store=store, **params) for _ in range(2)]
    for cache in caches:
        prefill(model, cache, ids[:, :prompt], chunk=8)
    lean = LeanDecoder(model)
    appended = []  # every in-place step ends with the buffer's views of one more slot
    original = WindowBuffer.views
    def counted(self, *args):
        appended.append(1)
        return original(self, *args)
    WindowBuffer.views = counted
    native_steps = []  # whether each native decode step updated the statistics itself
    original_step = DecodePlan.step
    def counted_step(self, *args):
        native_steps.append(bool(self.linear))
        return original_step(self, *args)
    DecodePlan.step = counted_step
    try:
        for t in range(prompt, prompt + steps):
            token = ids[:, t:t + 1]
            expected = model(input_ids=token, cache=caches[0], logits_to_keep=1).logits[:, -1]
            got = lean(token, caches[1])
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            assert caches[1].kept_counts().tolist() == caches[0].kept_counts().tolist()
    finally:
        WindowBuffer.views = original
        DecodePlan.step = original_step
    _decode_both.native_steps = native_steps
    return caches, len(appended)


@pytest.mark.skipif(not native.available(), reason="the in-place path reads with the native mass read")
@pytest.mark.parametrize("name,params", RANKED, ids=[r[0] for r in RANKED])
@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
def test_decode_step_equals_append_and_attend(name, params, asymmetric):
    (reference, lean), appended = _decode_both(name, params, StoreConfig(move_block=4), asymmetric=asymmetric)
    if name == "confkv" and not asymmetric:  # the gate gives the two sequences different budgets: holes, the general path
        assert 0 < appended < 30 * 2
    elif name == "confkv":  # (on the asymmetric model it need not)
        assert 0 < appended <= 30 * 2
    else:
        assert appended == 30 * 2  # every decode step of both layers took the in-place path
    # ... as one native call each, with the statistics updated in C for the linear observes (EMA, sum)
    assert len(_decode_both.native_steps) == appended
    assert set(_decode_both.native_steps) == {name in ("h2o", "confkv")}
    for a, b in zip(reference.layers, lean.layers):
        sa, sb = a.store, b.store
        assert torch.equal(sa.seen_real, sb.seen_real) and sa.seen_tokens == sb.seen_tokens
        for ra, rb in ((sa.old, sb.old), (sa.recent, sb.recent)):
            assert torch.equal(ra.positions, rb.positions) and torch.equal(ra.keys, rb.keys)
            torch.testing.assert_close(rb.stats, ra.stats, rtol=1e-6, atol=1e-7)
        # the lean store holds its buffer's spare slots too, and counts them
        spare = sb.window.nbytes() - sb.recent.nbytes() if sb.window is not None else 0
        assert sb.kv_bytes() == sa.kv_bytes() + spare
        if sb.window is not None:
            assert spare > 0 and sb.window.backs(sb.recent)


@pytest.mark.parametrize("name,params", RANKED, ids=[r[0] for r in RANKED])
def test_the_torch_in_place_step_equals_append_and_attend(name, params):
    """Without the library (or with a plan it cannot build) the in-place step runs in Python: the window
    buffer's append_one, the torch mass read and the policy's observe of both regions."""
    with native.loader.disabled():
        (reference, lean), appended = _decode_both(name, params, StoreConfig(move_block=4), steps=12,
                                                   asymmetric=True)
    assert appended > 0 and _decode_both.native_steps == []  # the Python in-place path, never the C step
    for a, b in zip(reference.layers, lean.layers):
        sa, sb = a.store, b.store
        assert torch.equal(sa.seen_real, sb.seen_real) and sa.seen_tokens == sb.seen_tokens
        for ra, rb in ((sa.old, sb.old), (sa.recent, sb.recent)):
            assert torch.equal(ra.positions, rb.positions) and torch.equal(ra.keys, rb.keys)
            torch.testing.assert_close(rb.stats, ra.stats, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not native.available(), reason="the in-place path reads with the native mass read")
def test_ageing_drops_the_buffer_and_a_stale_one_is_counted_whole():
    (_, lean), _ = _decode_both("h2o", {"budget": 20, "protect": 4}, StoreConfig(move_block=4), steps=5)
    store = lean.layers[0].store
    store._age(force=True)  # the recent region becomes a fresh copy
    assert store.window is None
    buffer = WindowBuffer.around(store.recent, store.recent.length + 3)
    store.window = buffer  # held but not backing the region: both are counted
    assert store.kv_bytes() == store.old.nbytes() + store.recent.nbytes() + buffer.nbytes()


@pytest.mark.parametrize("case", ["int8", "cold tier", "no mass", "padded", "two tokens"])
def test_the_other_steps_take_append_and_attend(case):
    model = tiny_model("llama")
    name, params, store = "h2o", {"budget": 20, "protect": 4}, StoreConfig()
    if case == "int8":
        name, params, store = "confkv", {"n_high": 16, "n_low": 28, "tau": 0.02, "protect": 4}, \
            StoreConfig(kv_int8=True, fp_window=8, move_block=8)
    elif case == "cold tier":
        name, params = "confkv-r", {"budget": 16, "protect": 4, "bits": 4, "page_size": 4, "group_size": 4, "k": 2}
    elif case == "no mass":
        name, params = "streaming", {"budget": 20, "sinks": 2}
    cache = ConfKVCache.for_model(model, name, store=store, **params)
    ids = torch.randint(1, 250, (2, 40), generator=torch.Generator().manual_seed(2))
    prefill(model, cache, ids[:, :24], chunk=8)
    lean = LeanDecoder(model)
    for t in range(24, 30):
        if case == "padded":
            lean(ids[:, t:t + 1], cache, attention_mask=torch.ones(2, t + 1, dtype=torch.long))
        elif case == "two tokens":
            lean(ids[:, t:t + 2], cache)
        else:
            lean(ids[:, t:t + 1], cache)
    assert all(layer.store.window is None for layer in cache.layers)


@pytest.mark.skipif(not native.available(), reason="the native decode step needs the library")
def test_a_cache_with_native_decode_plans_clones_and_pickles():
    import pickle

    (_, lean), _ = _decode_both("h2o", {"budget": 20, "protect": 4}, StoreConfig(move_block=4), steps=6)
    assert all(layer.store.decode_plan is not None for layer in lean.layers)
    twin = lean.clone()  # a deep copy: the plans (pointers into the original's tensors) are not copied
    assert all(layer.store.decode_plan is None for layer in twin.layers)
    assert pickle.loads(pickle.dumps(lean.layers[0].store.decode_plan)) is None
    model = tiny_model("llama")
    token = torch.tensor([[7], [9]])
    decoder = LeanDecoder(model)
    torch.testing.assert_close(decoder(token, twin), decoder(token, lean), rtol=0, atol=0)
    assert all(layer.store.decode_plan is not None for layer in twin.layers)  # its own, built at its step


@pytest.mark.skipif(not native.available(), reason="the native decode step needs the library")
def test_the_native_step_writes_slot_0_and_refuses_slots_outside_the_window():
    """DecodePlan.step on an empty window (slot 0, the first one: allowed) and at slot == capacity or < 0
    (outside: refused, nothing written). Region shapes: B 2, Hkv 3, D 8; 6 query heads."""
    from confkv.attention import KVSegment
    from confkv.attention.mass_read import mass_read

    old = _region(5, seed=3)
    window = WindowBuffer.around(_region(0), 2)
    plan = DecodePlan.build(window, old, 6, None)
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(2, 6, 1, 8, generator=gen)
    key, value = torch.randn(2, 3, 1, 8, generator=gen), torch.randn(2, 3, 1, 8, generator=gen)
    position = torch.tensor([5, 7])
    out, masses = plan.step(query, key, value, position, 0, 0.5)
    want, want_masses = mass_read(query, [KVSegment(old.keys, old.values, None), KVSegment(key, value, None)], 0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(masses, want_masses):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(window.keys[:, :, :1], key) and torch.equal(window.values[:, :, :1], value)
    assert window.positions[:, :, 0].tolist() == [[5] * 3, [7] * 3] and bool(window.valid[:, 0].all())
    before = window.keys.clone()
    for outside in (2, -1):
        with pytest.raises(RuntimeError, match="outside the window"):
            plan.step(query, key, value, position, outside, 0.5)
    torch.testing.assert_close(window.keys, before, rtol=0, atol=0, equal_nan=True)  # slot 1 still the poison (NaN)


@pytest.mark.skipif(not native.available(), reason="the native decode step")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("count", [2, 8])  # 8: MAX_STATS, the most a plan takes
def test_the_native_step_updates_each_of_several_statistics_by_its_own_rule(threads, count):
    """A plan lists every statistic with its own (scale, gain); the C step updates each, in the older region and in
    the window, as ``stat * scale + mass * gain`` from the masses the same step returns without a rule. Today's
    linear policies keep one statistic each, so a second one's place in the kernel's list, and the most it takes,
    had no test. B 2, Hkv 3, 6 query heads, D 64, 300 older slots (big enough for the pool at two threads)."""
    from confkv.native.decode import MAX_STATS

    assert count <= MAX_STATS
    rules = {f"s{k}": (1.0 - 0.1 * k, 0.5 + k) for k in range(count)}
    runs = []
    for linear in (None, rules):
        old = _region(300, seed=21, stats=tuple(rules), dim=64)
        window = WindowBuffer.around(_region(5, seed=22, stats=tuple(rules), dim=64), 8)
        gen = torch.Generator().manual_seed(23)
        query = torch.randn(2, 6, 1, 64, generator=gen)
        key, value = torch.randn(2, 3, 1, 64, generator=gen), torch.randn(2, 3, 1, 64, generator=gen)
        before = {name: (old.stats[name].clone(), window.stats[name][:, :, :5].clone()) for name in rules}
        with torch_threads(threads):
            out, masses = DecodePlan.build(window, old, 6, linear).step(query, key, value, torch.tensor([300, 300]), 5,
                                                                        0.125)
        runs.append((out, masses, old, window, before))
    (out, masses, _, _, before), (out_linear, no_masses, old, window, _) = runs
    assert no_masses is None and torch.equal(out, out_linear)
    for name, (scale, gain) in rules.items():
        old_before, window_before = before[name]
        window_before = torch.cat([window_before, torch.zeros(2, 3, 1)], dim=-1)  # the new slot's statistic starts at 0
        # bit for bit as torch's update (Policy.linear_observe: ``stat.mul_(scale).add_(mass, alpha=gain)``, whose
        # add is one fused multiply-add), so a store ranks the same tokens with the kernels on and off
        assert torch.equal(old.stats[name], old_before.mul(scale).add_(masses[0], alpha=gain))
        assert torch.equal(window.stats[name][:, :, :6], window_before.mul(scale).add_(masses[1], alpha=gain))


@pytest.mark.skipif(not native.available(), reason="the native decode step's plan")
def test_one_buffer_and_one_plan_serve_the_steps_until_the_window_is_replaced():
    """A step reuses the FP window's buffer while it backs the window and has a spare slot, and the plan while it
    serves them; a buffer is made with ``move_block`` spare slots once the step's token is in (its bytes are
    counted, so their number is part of the contract). B 2, tiny Llama, move_block 4, nothing evicted."""
    model = tiny_model("llama")
    ids = torch.randint(1, 250, (2, 40), generator=torch.Generator().manual_seed(5))
    cache = ConfKVCache.for_model(model, "h2o", store=StoreConfig(move_block=4), budget=200, protect=4)
    prefill(model, cache, ids[:, :20], chunk=8)
    lean = LeanDecoder(model)
    store = cache.layers[0].store
    fresh = reused = 0
    for t in range(20, 40):
        window, plan = store.window, store.decode_plan
        reusable = window is not None and window.backs(store.recent) and store.recent.length < window.capacity
        serves = reusable and plan is not None and plan.serves(window, store.old)
        lean(ids[:, t:t + 1], cache)
        if reusable:
            assert store.window is window or store.window is None  # None: the step aged the window
            reused += store.window is window
            if serves and store.window is window:
                assert store.decode_plan is plan
        if store.window is not None and store.window is not window:
            fresh += 1
            assert store.window.capacity - store.recent.length == 4  # move_block spare slots after the token
    assert fresh >= 2 and reused >= 8


def _two_prefilled_h2o_caches(model, ids: torch.Tensor, prompt: int) -> list[ConfKVCache]:
    """Two H2O caches (nothing evicted, move_block 4) with ``ids[:, :prompt]`` prefilled: model(...) decodes into
    the first, the lean decoder into the second."""
    caches = [ConfKVCache.for_model(model, "h2o", store=StoreConfig(move_block=4), budget=200, protect=4)
              for _ in range(2)]
    for cache in caches:
        prefill(model, cache, ids[:, :prompt], chunk=8)
    return caches


@pytest.mark.skipif(not native.available(), reason="the native decode step")
def test_a_full_buffer_that_backs_the_window_is_replaced_before_the_write():
    """A buffer with no spare slot left (it backs the window exactly) is replaced by a larger one, not written
    past: the step's logits equal model(...)'s. B 2, tiny Llama."""
    model = tiny_model("llama")
    ids = torch.randint(1, 250, (2, 26), generator=torch.Generator().manual_seed(6))
    caches = _two_prefilled_h2o_caches(model, ids, 24)
    lean = LeanDecoder(model)
    lean(ids[:, 24:25], caches[1])
    model(input_ids=ids[:, 24:25], cache=caches[0])
    fulls = []
    for layer in caches[1].layers:
        store = layer.store
        full = WindowBuffer.around(store.recent, store.recent.length)
        store.window, store.recent = full, full.views(store.recent.length)
        assert full.backs(store.recent) and store.recent.length == full.capacity
        fulls.append(full)
    expected = model(input_ids=ids[:, 25:26], cache=caches[0], logits_to_keep=1).logits[:, -1]
    torch.testing.assert_close(lean(ids[:, 25:26], caches[1]), expected, rtol=1e-5, atol=1e-5)
    for layer, full in zip(caches[1].layers, fulls):
        assert layer.store.window is not full and layer.store.window.backs(layer.store.recent)


@pytest.mark.skipif(not native.available(), reason="the native decode step and mass read")
@pytest.mark.parametrize("with_plan", [True, False], ids=["plan", "no plan"])
def test_the_in_place_step_reads_natively_and_times_its_sections_under_the_bench_names(with_plan, monkeypatch):
    """With its plan the step is one timed section, "native decode step"; without one (the plan refused) it is
    "append (FP window)", "attention read" (the native mass read, whose output is used: torch's read never runs)
    and "EMA / stats update", the name `confkv bench` counts as policy work. B 2, tiny Llama, H2O, 3 steps."""
    from confkv import profiling
    from confkv.eval.bench.run import POLICY_SECTIONS

    import confkv.store.read as read_module

    model = tiny_model("llama")
    ids = torch.randint(1, 250, (2, 23), generator=torch.Generator().manual_seed(7))
    caches = _two_prefilled_h2o_caches(model, ids, 20)
    if not with_plan:
        monkeypatch.setattr(DecodePlan, "build", classmethod(lambda cls, *args: None))

        def torch_read(*args):
            raise AssertionError("the torch mass read ran where the native one reads")

        monkeypatch.setattr(read_module, "mass_read", torch_read)
    lean, timers = LeanDecoder(model), profiling.Timers()
    for t in range(20, 23):
        with profiling.enabled(timers):
            got = lean(ids[:, t:t + 1], caches[1])
        expected = model(input_ids=ids[:, t:t + 1], cache=caches[0], logits_to_keep=1).logits[:, -1]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    layers, steps = len(caches[1].layers), 3
    sections = dict(timers.calls)
    if with_plan:
        assert sections.get("native decode step") == layers * steps and "attention read" not in sections
    else:
        assert "native decode step" not in sections
        for name in ("append (FP window)", "attention read", "EMA / stats update"):
            assert sections.get(name) == layers * steps, (name, sections)
        assert "EMA / stats update" in POLICY_SECTIONS


def test_the_first_tokens_of_a_fresh_cache_decode_as_the_model_does():
    """One token at a time from an empty cache (no prefill): the first step finds no region to write in place
    and appends; later steps may take the in-place step. Logits equal model(...)'s. B 2, tiny Llama."""
    model = tiny_model("llama")
    ids = torch.randint(1, 250, (2, 6), generator=torch.Generator().manual_seed(8))
    caches = [ConfKVCache.for_model(model, "h2o", store=StoreConfig(move_block=4), budget=200, protect=4)
              for _ in range(2)]
    lean = LeanDecoder(model)
    for t in range(6):
        expected = model(input_ids=ids[:, t:t + 1], cache=caches[0], logits_to_keep=1).logits[:, -1]
        torch.testing.assert_close(lean(ids[:, t:t + 1], caches[1]), expected, rtol=1e-5, atol=1e-5)


def _ready_store(name="h2o", params=None, store=None, **model_overrides):
    """A prefilled layer store that may take the in-place step, with a matching new key and query:
    (store, keys [2, 2, 1, 16], query [2, 4, 1, 16]) of a tiny Llama (2 KV heads, 4 query heads)."""
    model = tiny_model("llama", **model_overrides)
    cache = ConfKVCache.for_model(model, name, store=store or StoreConfig(), **(params or {"budget": 200, "protect": 4}))
    prefill(model, cache, torch.randint(1, 250, (2, 20), generator=torch.Generator().manual_seed(9)), chunk=8)
    gen = torch.Generator().manual_seed(10)
    return cache.layers[0].store, torch.randn(2, 2, 1, 16, generator=gen), torch.randn(2, 4, 1, 16, generator=gen)


def _change_nothing(store, keys, query):
    return keys, query


CANNOT = {
    "two new keys": lambda s, k, q: (torch.cat([k, k], 2), q),
    "two queries": lambda s, k, q: (k, torch.cat([q, q], 2)),
    "keys in another dtype": lambda s, k, q: (k.bfloat16(), q),
    "a query on another device": lambda s, k, q: (k, q.to("meta")),
    "a pending token": lambda s, k, q: (s.append(k, k) or k, q),
    "another read backend": lambda s, k, q: (setattr(s, "config", dataclasses.replace(s.config, read_backend="torch"))
                                            or k, q),
    "an INT8 store": lambda s, k, q: (setattr(s, "int8", True) or k, q),
    "a sliding layer": lambda s, k, q: (setattr(s, "sliding_window", 8) or k, q),
    "no statistics": lambda s, k, q: (setattr(s, "stat_names", ()) or k, q),
    "a padded older region": lambda s, k, q: (setattr(s.old, "all_valid", False) or k, q),
    "a padded window": lambda s, k, q: (setattr(s.recent, "all_valid", False) or k, q),
}


@pytest.mark.parametrize("case", ["possible", *CANNOT])
def test_the_in_place_check_refuses_each_step_it_cannot_take(case):
    """``can_decode_in_place`` is True for one full-precision token of an attention-ranked store on CPU, and False
    when any one condition fails (each case changes one thing)."""
    store, keys, query = _ready_store()
    keys, query = CANNOT.get(case, _change_nothing)(store, keys, query)
    assert store.can_decode_in_place(keys, query) is (case == "possible")


@pytest.mark.parametrize("case", ["a memory target", "a cold tier", "no attention mass"])
def test_the_in_place_check_refuses_other_stores(case):
    name, params = {"a memory target": ("h2o", {"memory": 0.5, "protect": 4}),  # evicted tokens dropped: no cold tier
                    "a cold tier": ("confkv-r", {"budget": 16, "protect": 4, "bits": 4, "page_size": 4,
                                                 "group_size": 4, "k": 2}),
                    "no attention mass": ("streaming", {"budget": 20, "sinks": 2})}[case]
    store, keys, query = _ready_store(name, params)
    assert not store.can_decode_in_place(keys, query)


def test_the_in_place_check_holds_to_the_score_limit(monkeypatch):
    """The step's scores, B x Hq x (slots + 1), may reach MAX_SCORES exactly, not one more."""
    import confkv.store.read as read_module

    store, keys, query = _ready_store()
    scores = query.shape[0] * query.shape[1] * (store.physical_length + 1)
    monkeypatch.setattr(read_module, "MAX_SCORES", scores)
    assert store.can_decode_in_place(keys, query)
    monkeypatch.setattr(read_module, "MAX_SCORES", scores - 1)
    assert not store.can_decode_in_place(keys, query)
