"""KIVI pages encoded and decoded in one C call (``c/page_encode.c`` through :mod:`confkv.native.page_encode`): the
codes, float16 scales and minima of the torch code (:mod:`confkv.tiers.lowbit`), bit for bit, at every width, group
and value group the formats use, over valid masks with empty groups, float16 ties, zeros and float16-subnormal
scales (a zero minimum's sign aside, where a group holds zeros of both signs); the decoded pages equal torch's bit for
bit; a NaN, an infinity or a value float16 cannot hold goes back to torch. Then
through the formats and a ladder's cache: the same pages, logits and bytes with the call as without it."""

from __future__ import annotations

import pytest
import torch

from confkv import native
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from confkv.native import loader, page_encode
from confkv.tiers import lowbit
from confkv.tiers.formats import build_format
from decode_stream import decode_logits, same_cache_state

pytestmark = pytest.mark.skipif(not native.available(), reason="the call needs the library")


def _pages(seed: int, lead=(2, 3, 2), page: int = 64, dim: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys, values [*lead, page, dim] of every magnitude, zeros (both signs), float16-exact ties, tiny groups;
    valid [*lead, page] with some slots and a whole page invalid."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(*lead, page, dim, generator=gen) * 10.0 ** torch.randint(-4, 4, (*lead, 1, dim), generator=gen)
    values = torch.randn(*lead, page, dim, generator=gen) * 10.0 ** torch.randint(-4, 4, (*lead, page, 1),
                                                                                     generator=gen)
    valid = torch.rand(*lead, page, generator=gen) > 0.25
    k, v, ok = keys.view(-1, page, dim), values.view(-1, page, dim), valid.view(-1, page)  # the pages, in a row
    k[0] = k[0].half().float()  # values on float16's grid: codes at exact ties
    v[0] = torch.randint(-8, 8, (page, dim), generator=gen) / 4.0
    k[-1, :, :4], v[-1, :4] = 0.0, -0.0
    k[len(k) // 2] *= 1e-6  # a scale below float16's smallest normal
    ok[-1] = False  # a page with no valid slot: its key groups' ranges are 0 .. 0
    return keys, values, valid


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, dtypes and values (float16 tensors, the scales and minima, compared by their bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.int16) if a.dtype == torch.float16 else a,
                       b.view(torch.int16) if b.dtype == torch.float16 else b)


@pytest.mark.parametrize("key_bits,value_bits", [(2, 2), (3, 3), (4, 4), (8, 8), (4, 2), (8, 3)])
@pytest.mark.parametrize("group,vgroup", [(64, 64), (32, 16), (16, 8)])
@pytest.mark.parametrize("seed", [0, 1])
def test_codes_scales_minima_and_decoded_pages_are_torchs(key_bits, value_bits, group, vgroup, seed):
    keys, values, valid = _pages(seed)
    got = page_encode.encode_kivi(keys, values, valid, key_bits, value_bits, group, vgroup)
    qk = lowbit.quantize_keys(keys, valid, key_bits, group)
    qv = lowbit.quantize_values(values, value_bits, vgroup)
    want = {"key_codes": qk.codes, "key_scale": qk.scale, "key_min": qk.minimum,
            "value_codes": qv.codes, "value_scale": qv.scale, "value_min": qv.minimum}
    assert got is not None and got.keys() == want.keys()
    for name in want:
        assert _same(got[name], want[name]), name
    decoded = page_encode.decode_kivi(got, key_bits, value_bits, group, vgroup)
    assert decoded is not None
    assert torch.equal(decoded[0], lowbit.dequantize_keys(qk, key_bits, 64, group))
    assert torch.equal(decoded[1], lowbit.dequantize_values(qv, value_bits, 64, vgroup))


def test_a_group_at_float16s_largest_value_is_torchs():
    keys, values, valid = _pages(5, lead=(1, 1))
    keys[0, 0, 3:9, 7], values[0, 0, 10, :] = 65510.0, -65510.0  # float16 rounds it to its largest, 65504
    keys[0, 0, 20:22, 7], values[0, 0, 11, :5] = -65510.0, 65510.0  # ranges of about 131,000
    got = page_encode.encode_kivi(keys, values, valid, 2, 2, 64, 64)
    qk, qv = lowbit.quantize_keys(keys, valid, 2, 64), lowbit.quantize_values(values, 2, 64)
    assert _same(got["key_scale"], qk.scale) and _same(got["key_codes"], qk.codes)
    assert _same(got["value_min"], qv.minimum) and _same(got["value_codes"], qv.codes)


def test_zeros_of_both_signs_give_torchs_values():
    """A group whose least entry is a zero of either sign: torch's min may keep either (its vectorisation decides),
    so the stored minimum's sign may differ; its value, every code, scale and decoded entry are torch's."""
    gen = torch.Generator().manual_seed(9)
    keys, values = torch.rand(2, 64, 64, generator=gen) + 1, torch.rand(2, 64, 64, generator=gen) + 1
    for i in range(12):
        sign = 1.0 if i % 2 else -1.0
        keys[i % 2, (7 * i) % 64, :], values[i % 2, :, (5 * i) % 64] = 0.0 * sign, 0.0 * sign
    valid = torch.ones(2, 64, dtype=torch.bool)
    got = page_encode.encode_kivi(keys, values, valid, 3, 3, 64, 64)
    qk, qv = lowbit.quantize_keys(keys, valid, 3, 64), lowbit.quantize_values(values, 3, 64)
    for name, want in (("key_codes", qk.codes), ("key_scale", qk.scale), ("key_min", qk.minimum),
                       ("value_codes", qv.codes), ("value_scale", qv.scale), ("value_min", qv.minimum)):
        assert torch.equal(got[name], want), name  # -0 == +0
    decoded = page_encode.decode_kivi(got, 3, 3, 64, 64)
    assert _same(decoded[0].view(torch.int32), lowbit.dequantize_keys(qk, 3, 64, 64).view(torch.int32))
    assert _same(decoded[1].view(torch.int32), lowbit.dequantize_values(qv, 3, 64, 64).view(torch.int32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 65520.0, -7e4])
def test_a_value_float16_cannot_hold_is_left_to_torch(bad):
    keys, values, valid = _pages(2, lead=(1, 2))
    for which in ("keys", "values"):
        for where in ((0, 1, 5, 9), (0, 0, 0, 0), (-1, -1, -1, -1)):  # inside, the first entry, the last
            k, v = keys.clone(), values.clone()
            (k if which == "keys" else v)[where] = bad
            assert page_encode.encode_kivi(k, v, valid, 4, 4, 64, 64) is None, (which, where)


def test_what_the_call_does_not_take_is_left_to_torch():
    keys, values, valid = _pages(3, lead=(1, 2))
    assert page_encode.encode_kivi(keys.double(), values.double(), valid, 4, 4, 64, 64) is None
    assert page_encode.encode_kivi(keys, values, valid.int(), 4, 4, 64, 64) is None
    assert page_encode.encode_kivi(keys, values, valid, 5, 4, 64, 64) is None  # no such width
    assert page_encode.encode_kivi(keys, values, valid, 4, 4, 48, 64) is None  # a group that does not divide a page
    assert page_encode.encode_kivi(keys, values, valid, 4, 4, 64, 24) is None  # nor a value group the channels
    assert page_encode.encode_kivi(keys[..., :60], values[..., :60], valid, 3, 3, 64, 4) is None  # 3 bits: 8 a word
    data = page_encode.encode_kivi(keys, values, valid, 4, 4, 64, 64)
    assert page_encode.decode_kivi(data, 4, 4, 32, 64) is None  # scales of another group
    assert page_encode.decode_kivi({**data, "value_min": data["value_min"].float()}, 4, 4, 64, 64) is None
    assert page_encode.decode_kivi({k: t for k, t in data.items() if k != "key_min"}, 4, 4, 64, 64) is None
    with loader.disabled():
        assert page_encode.encode_kivi(keys, values, valid, 4, 4, 64, 64) is None
        assert page_encode.decode_kivi(data, 4, 4, 64, 64) is None


def _without_the_call(monkeypatch) -> None:
    monkeypatch.setattr(page_encode, "encode_kivi", lambda *args: None)
    monkeypatch.setattr(page_encode, "decode_kivi", lambda *args: None)


@pytest.mark.parametrize("fmt", ["kivi", "kivi+hadamard"])
@pytest.mark.parametrize("bits,value_bits", [(3, None), (4, 2), (8, None)])
def test_a_formats_pages_are_the_same_with_the_call_as_without_it(fmt, bits, value_bits, monkeypatch):
    keys, values, valid = _pages(4)
    fast = build_format(bits, 32, 64, torch.bfloat16, fmt, value_bits=value_bits)
    slow = build_format(bits, 32, 64, torch.bfloat16, fmt, value_bits=value_bits)
    got = fast.encode(keys, values, valid)
    decoded = {rotated: fast.decode(got, rotated=rotated) for rotated in (False, fmt != "kivi")}
    _without_the_call(monkeypatch)
    want = slow.encode(keys, values, valid)
    assert got.keys() == want.keys() and all(_same(got[name], want[name]) for name in want)
    for rotated, (k, v) in decoded.items():
        want_k, want_v = slow.decode(want, rotated=rotated)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)


def _stream(policy, memory, batch, monkeypatch, with_call: bool, steps: int = 100):
    calls = {"encode": 0, "decode": 0}
    encode, decode = page_encode.encode_kivi, page_encode.decode_kivi

    def counted(name, real):
        def call(*args):
            out = real(*args) if with_call else None
            calls[name] += out is not None
            return out
        return call

    monkeypatch.setattr(page_encode, "encode_kivi", counted("encode", encode))
    monkeypatch.setattr(page_encode, "decode_kivi", counted("decode", decode))
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, policy, memory=memory)
    ids = torch.randint(0, 250, (batch, 200 + steps), generator=torch.Generator().manual_seed(7))
    logits = decode_logits(model, cache, ids, 200, 64)
    monkeypatch.undo()
    return logits, cache, calls


@pytest.mark.parametrize("policy,memory,batch", [(None, 0.25, 1), (None, 0.125, 2), ("tiered-int8", 0.25, 1)])
def test_a_ladders_cache_decodes_the_same_with_the_call_as_without_it(policy, memory, batch, monkeypatch):
    """Pages sealed and stepped down the ladder (encode, and decode for every step down) by the call: the same
    logits, pages and bytes as the torch code's."""
    logits, cache, calls = _stream(policy, memory, batch, monkeypatch, True)
    want_logits, want_cache, none = _stream(policy, memory, batch, monkeypatch, False)
    assert calls["encode"] > 10 and calls["decode"] > 5 and none == {"encode": 0, "decode": 0}
    assert torch.equal(logits, want_logits)
    same_cache_state(cache, want_cache)
