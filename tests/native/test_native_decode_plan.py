"""The native decode step's plan (confkv/native/decode.py): when a plan still serves a store, and what its step
takes. The step's numbers against append + attend are in tests/store/test_window_buffer.py.

Shapes here: B 2, Hkv 3, 6 query heads, D 8 (``_region``).
"""

from __future__ import annotations

import pytest
import torch

from confkv import native
from confkv.attention import KVSegment
from confkv.attention.mass_read import mass_read
from confkv.native.decode import DecodePlan
from confkv.store.hot_tier import Region
from confkv.store.window_buffer import WindowBuffer

pytestmark = [pytest.mark.usefixtures("nan_filled_empty"),
              pytest.mark.skipif(not native.available(), reason="the native decode step needs the library")]


def _region(length: int, seed: int = 0, dim: int = 8) -> Region:
    gen = torch.Generator().manual_seed(seed)
    return Region(keys=torch.randn(2, 3, length, dim, generator=gen), values=torch.randn(2, 3, length, dim, generator=gen),
                  positions=torch.arange(length).expand(2, 3, length).clone(), valid=torch.ones(2, length, dtype=torch.bool),
                  stats={"ema": torch.rand(2, 3, length, generator=gen)}, all_valid=True)


def _token(seed: int, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 6, 1, dim, generator=gen), torch.randn(2, 3, 1, dim, generator=gen),
            torch.randn(2, 3, 1, dim, generator=gen))


def test_a_plan_serves_only_the_window_and_older_region_it_was_built_on():
    old, window = _region(5, seed=1), WindowBuffer.around(_region(2, seed=2), 4)
    plan = DecodePlan.build(window, old, 6, None)
    assert plan.serves(window, old)  # built once, used while both stand: no plan per step
    assert not plan.serves(window, _region(5, seed=1))  # the older region replaced (ageing, eviction)
    assert not plan.serves(WindowBuffer.around(_region(2, seed=2), 4), old)  # a new window buffer
    old.keys = old.keys.clone()  # the region kept, its keys' storage replaced: the plan's pointer is stale
    assert not plan.serves(window, old)


def test_a_plan_serves_nothing_once_its_tensors_are_gone():
    """Weak references: a plan never keeps a replaced buffer alive, and a gone one is never served."""
    import gc

    old = _region(5, seed=1)
    window = WindowBuffer.around(_region(2, seed=2), 4)
    plan = DecodePlan.build(window, old, 6, None)
    del window
    gc.collect()
    assert plan.window_ref() is None
    assert not plan.serves(WindowBuffer.around(_region(2, seed=2), 4), old)


def test_the_step_reads_a_query_whose_channels_are_strided():
    """A query whose last dimension is not contiguous (a slice of every other channel) is copied before the C
    call, which reads channels at stride 1: the output equals the contiguous query's and the torch read's."""
    old = _region(5, seed=3)
    results = []
    for strided in (False, True):
        window = WindowBuffer.around(_region(2, seed=4), 4)
        query, key, value = _token(5)
        if strided:
            wide = torch.zeros(2, 6, 1, 16)
            wide[..., ::2] = query
            query = wide[..., ::2]
            assert query.stride(-1) == 2
        out, masses = DecodePlan.build(window, old, 6, None).step(query, key, value, torch.tensor([5, 5]), 2, 0.5)
        results.append((out, masses))
    (out, masses), (strided_out, strided_masses) = results
    torch.testing.assert_close(strided_out, out, rtol=0, atol=0)
    for a, b in zip(masses, strided_masses):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    query, key, value = _token(5)
    window_keys = torch.cat([_region(2, seed=4).keys, key], dim=2)
    window_values = torch.cat([_region(2, seed=4).values, value], dim=2)
    want, _ = mass_read(query, [KVSegment(old.keys, old.values, None), KVSegment(window_keys, window_values, None)], 0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def _stats(names, length: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(2, 3, length, dtype=dtype) for name in names}


# Each case breaks one of the call's conditions on otherwise good tensors: (label, change (window, old) -> q_heads).
def _half(w, o):
    for region in (w, o):
        region.keys, region.values = region.keys.half(), region.values.half()


REFUSALS = {
    "float16 tensors": _half,
    "older keys in another dtype": lambda w, o: setattr(o, "keys", o.keys.bfloat16()),
    "older values in another dtype": lambda w, o: setattr(o, "values", o.values.bfloat16()),
    "an INT8 older region": lambda w, o: setattr(o, "key_scale", torch.ones(2, 3, 1, 8)),
    "query heads not a multiple of the KV heads": lambda w, o: 7,
    "window keys not contiguous": lambda w, o: setattr(w, "keys", w.keys.transpose(0, 1).contiguous().transpose(0, 1)),
    "window values not contiguous": lambda w, o: setattr(w, "values",
                                                         w.values.transpose(0, 1).contiguous().transpose(0, 1)),
    "window positions not contiguous": lambda w, o: setattr(w, "positions",
                                                            w.positions.transpose(0, 1).contiguous().transpose(0, 1)),
    "window validity not contiguous": lambda w, o: setattr(w, "valid", w.valid.t().contiguous().t()),
    "int32 positions": lambda w, o: setattr(w, "positions", w.positions.int()),
    "validity not bool": lambda w, o: setattr(w, "valid", w.valid.to(torch.uint8)),
    "older keys strided by channel": lambda w, o: setattr(o, "keys", torch.randn(2, 3, 5, 16)[..., ::2]),
    "older values strided by channel": lambda w, o: setattr(o, "values", torch.randn(2, 3, 5, 16)[..., ::2]),
    "older region of other KV heads": lambda w, o: [setattr(o, n, getattr(o, n)[:, :2]) for n in ("keys", "values")],
    "older region of another batch": lambda w, o: [setattr(o, n, getattr(o, n)[:1]) for n in ("keys", "values")],
    "more statistics than the call takes": lambda w, o: [setattr(r, "stats", _stats([f"s{k}" for k in range(9)], n))
                                                         for r, n in ((w, 4), (o, 5))],
    "statistics of other names": lambda w, o: setattr(o, "stats", _stats(["h2o"], 5)),
    "float64 statistics": lambda w, o: setattr(o, "stats", _stats(["ema"], 5, torch.float64)),
    "window statistics not contiguous": lambda w, o: setattr(
        w, "stats", {"ema": torch.zeros(3, 2, 4).transpose(0, 1)}),
}


@pytest.mark.parametrize("label", sorted(REFUSALS))
def test_build_refuses_each_layout_the_call_cannot_take(label):
    """None (the store then takes the torch step) for every tensor the C call would misread; the same tensors
    without the change give a plan. Older region 5 slots, window 2 of 4."""
    old, window = _region(5, seed=1), WindowBuffer.around(_region(2, seed=2), 4)
    assert DecodePlan.build(window, old, 6, None) is not None
    q_heads = REFUSALS[label](window, old)
    assert DecodePlan.build(window, old, q_heads if isinstance(q_heads, int) else 6, None) is None


def test_build_takes_a_strided_older_region_with_contiguous_channels_and_drops_a_partial_linear_rule():
    """The older region may be a view (any strides but the channels'); a linear rule must name every statistic,
    else the plan returns the masses for the policy's observe."""
    old = _region(5, seed=1)
    old.keys = torch.randn(2, 3, 9, 8)[:, :, 2:7]  # slots strided past a bigger tensor: contiguous channels
    window = WindowBuffer.around(_region(2, seed=2), 4)
    assert DecodePlan.build(window, old, 6, None) is not None
    assert DecodePlan.build(window, old, 6, {"ema": (0.5, 1.0)}).linear == {"ema": (0.5, 1.0)}
    assert DecodePlan.build(window, old, 6, {"other": (0.5, 1.0)}).linear is None


def test_the_masses_are_float32_whatever_torch_default_dtype():
    """The call writes float32 masses: they are made float32 even when torch's default dtype is float64."""
    old, window = _region(5, seed=1), WindowBuffer.around(_region(2, seed=2), 4)
    query, key, value = _token(6)
    plan = DecodePlan.build(window, old, 6, None)
    want_out, want = mass_read(query, [KVSegment(old.keys, old.values, None),
                                       KVSegment(torch.cat([_region(2, seed=2).keys, key], 2),
                                                 torch.cat([_region(2, seed=2).values, value], 2), None)], 0.5)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out, masses = plan.step(query, key, value, torch.tensor([5, 5]), 2, 0.5)
    finally:
        torch.set_default_dtype(before)
    assert [m.dtype for m in masses] == [torch.float32, torch.float32]
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    for got, expected in zip(masses, want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


class _Refusing:
    """A stand-in for the library whose decode step returns ``status``."""

    def __init__(self, status: int) -> None:
        self.status = status

    def confkv_decode_step(self, *args) -> int:
        return self.status


@pytest.mark.parametrize("status, error, words", [
    (1, MemoryError, "out of memory for the scores"),
    (2, RuntimeError, "slot 2 is outside the window's 4 slots (the store and its plan are out of step)")])
def test_the_step_names_what_the_call_refused(status, error, words):
    old, window = _region(5, seed=1), WindowBuffer.around(_region(2, seed=2), 4)
    plan = DecodePlan.build(window, old, 6, None)
    plan.lib = _Refusing(status)
    query, key, value = _token(6)
    with pytest.raises(error) as refused:
        plan.step(query, key, value, torch.tensor([5, 5]), 2, 0.5)
    assert str(refused.value) == f"confkv native decode step: {words}"
