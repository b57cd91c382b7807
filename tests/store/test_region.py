"""A :class:`confkv.store.hot_tier.Region` on small hand-made slots: what gather, slice, concat and
select_batch keep, and the bytes it reports, against expectations written out by hand.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

import pytest
import torch
from confkv.store.hot_tier import Region, concat, select_batch
from confkv import quant


def _int8_region(batch: int = 2, heads: int = 2, length: int = 5, dim: int = 3) -> Region:
    """Slot ``t`` of row ``b``, head ``h`` holds the code ``100*b + 10*h + t`` (so every value says where it came from)."""
    code = (100 * torch.arange(batch)[:, None, None] + 10 * torch.arange(heads)[None, :, None]
            + torch.arange(length)[None, None, :])  # [B, H, L]
    keys = (code[..., None] % 128).expand(-1, -1, -1, dim).to(torch.int8).clone()
    return Region(keys=keys, values=(-keys).clone(), positions=code.clone(),
                  valid=torch.ones(batch, length, dtype=torch.bool), stats={"ema": code.float() / 1000},
                  key_scale=code.float() + 0.5, value_scale=code.float() + 0.25)


def test_empty_region_shapes_and_dtypes():
    fp = Region.empty(2, 3, 4, torch.float16, torch.device("cpu"), ("ema", "acc"))
    assert fp.keys.shape == (2, 3, 0, 4) and fp.keys.dtype == torch.float16 and fp.values.dtype == torch.float16
    assert fp.positions.shape == (2, 3, 0) and fp.positions.dtype == torch.int64
    assert fp.valid.shape == (2, 0) and fp.valid.dtype == torch.bool
    assert set(fp.stats) == {"ema", "acc"} and fp.stats["ema"].shape == (2, 3, 0)
    assert fp.stats["ema"].dtype == torch.float32
    assert fp.key_scale is None and fp.value_scale is None and fp.all_valid and not fp.is_int8 and fp.length == 0
    q = Region.empty(2, 3, 4, torch.float16, torch.device("cpu"), (), int8=True)
    assert q.keys.dtype == torch.int8 and q.values.dtype == torch.int8 and q.is_int8
    assert q.key_scale.shape == (2, 3, 0) and q.key_scale.dtype == torch.float32
    assert q.value_scale.shape == (2, 3, 0) and q.value_scale.dtype == torch.float32


def test_gather_moves_int8_bytes_scales_positions_and_stats_per_head():
    region = _int8_region()
    index = torch.tensor([[[4, 0], [1, 3]], [[2, 2], [0, 4]]])  # [B=2, H=2, K=2]
    valid = torch.tensor([[True, True], [True, False]])
    kept = region.gather(index, valid, all_valid=False)
    for b in range(2):
        for h in range(2):
            for k in range(2):
                t = int(index[b, h, k])
                code = 100 * b + 10 * h + t
                assert kept.positions[b, h, k] == code
                assert kept.keys[b, h, k].tolist() == [code % 128] * 3
                assert kept.values[b, h, k].tolist() == [-(code % 128)] * 3
                assert kept.key_scale[b, h, k] == code + 0.5
                assert kept.value_scale[b, h, k] == code + 0.25
                assert kept.stats["ema"][b, h, k] == torch.tensor(code / 1000, dtype=torch.float32)
    assert kept.valid is valid and kept.all_valid is False
    assert region.gather(index, valid).all_valid is False  # by default the result is not promised dense (the safe side)
    assert kept.gather(torch.zeros(2, 2, 1, dtype=torch.int64), valid[:, :1], all_valid=True).all_valid is True


def test_slice_view_and_copy():
    region = _int8_region(length=6)
    view = region.slice(1, 4)
    copy = region.slice(1, 4, copy=True)
    for part in (view, copy):
        assert part.length == 3
        assert part.positions[1, 1].tolist() == [111, 112, 113]
        assert part.key_scale[0, 1].tolist() == [11.5, 12.5, 13.5]
        assert part.value_scale[0, 0].tolist() == [1.25, 2.25, 3.25]
        assert part.stats["ema"].shape == (2, 2, 3) and part.valid.shape == (2, 3)
    assert view.keys.untyped_storage().data_ptr() == region.keys.untyped_storage().data_ptr()
    assert view.valid.untyped_storage().data_ptr() == region.valid.untyped_storage().data_ptr()
    for name in ("keys", "values", "positions", "key_scale", "value_scale"):
        assert getattr(copy, name).untyped_storage().data_ptr() != getattr(region, name).untyped_storage().data_ptr()
    assert copy.stats["ema"].untyped_storage().data_ptr() != region.stats["ema"].untyped_storage().data_ptr()
    assert copy.valid.untyped_storage().data_ptr() != region.valid.untyped_storage().data_ptr()
    assert region.slice(0, 2).all_valid is False and region.slice(0, 2, copy=True).all_valid is False
    region.all_valid = True
    assert region.slice(0, 2).all_valid is True and region.slice(0, 2, copy=True).all_valid is True


def test_nbytes_counts_data_and_scales_and_bookkeeping_apart():
    region = _int8_region(batch=2, heads=2, length=5, dim=3)
    # int8 keys + values: 2 * (2*2*5*3) bytes; float32 scales: 2 * (2*2*5) * 4 bytes
    assert region.nbytes() == 2 * 60 + 2 * 20 * 4
    # int64 positions 20*8, bool valid 2*5, one float32 statistic 20*4
    assert region.bookkeeping_nbytes() == 160 + 10 + 80
    fp = Region(keys=torch.zeros(1, 2, 4, 8, dtype=torch.float16), values=torch.zeros(1, 2, 4, 8, dtype=torch.float16),
                positions=torch.zeros(1, 2, 4, dtype=torch.int64), valid=torch.ones(1, 4, dtype=torch.bool))
    assert fp.nbytes() == 2 * 64 * 2
    assert fp.bookkeeping_nbytes() == 64 + 4


def test_concat_appends_along_the_slot_axis():
    first, second = _int8_region(length=2), _int8_region(length=3)
    second.valid[1, 2] = False
    second.all_valid = False
    both = concat(first, second)
    assert both.length == 5
    assert both.positions[1, 0].tolist() == [100, 101, 100, 101, 102]
    assert both.key_scale[0, 1].tolist() == [10.5, 11.5, 10.5, 11.5, 12.5]
    assert both.value_scale[0, 1].tolist() == [10.25, 11.25, 10.25, 11.25, 12.25]
    assert both.values[1, 1, :, 0].tolist() == [-110, -111, -110, -111, -112]
    assert both.valid.tolist() == [[True] * 5, [True, True, True, True, False]]
    assert both.stats["ema"].shape == (2, 2, 5)
    assert both.all_valid is False
    first.all_valid = True
    one = _int8_region(length=1)
    assert concat(first, one).all_valid is False  # neither dense flag alone makes the result dense
    one.all_valid = True
    assert concat(first, one).all_valid is True
    fp = Region(keys=torch.zeros(1, 1, 2, 2), values=torch.zeros(1, 1, 2, 2), positions=torch.zeros(1, 1, 2, dtype=torch.int64),
                valid=torch.ones(1, 2, dtype=torch.bool))
    assert concat(fp, fp).key_scale is None and concat(fp, fp).value_scale is None


def test_select_batch_picks_rows_of_every_tensor():
    region = _int8_region(batch=3, length=2)
    region.valid[2, 1] = False
    picked = select_batch(region, torch.tensor([2, 0]))
    assert picked.positions[:, 0, 0].tolist() == [200, 0]
    assert picked.keys[:, 1, 1, 0].tolist() == [(211) % 128 - 0, 11]
    assert picked.values[:, 0, 0, 0].tolist() == [-(200 % 128), 0]
    assert picked.key_scale[:, 0, 1].tolist() == [201.5, 1.5]
    assert picked.value_scale[:, 0, 1].tolist() == [201.25, 1.25]
    assert picked.stats["ema"][:, 0, 0].tolist() == [torch.tensor(0.2).item(), 0.0]
    assert picked.valid.tolist() == [[True, False], [True, True]]
    assert select_batch(region, torch.tensor([0])).all_valid is False
    region.all_valid = True
    assert select_batch(region, torch.tensor([0])).all_valid is True


def test_select_batch_of_a_full_precision_region_has_no_scales():
    region = Region(keys=torch.arange(12.0).view(3, 1, 2, 2), values=-torch.arange(12.0).view(3, 1, 2, 2),
                    positions=torch.arange(6).view(3, 1, 2), valid=torch.ones(3, 2, dtype=torch.bool))
    picked = select_batch(region, torch.tensor([1]))
    assert picked.key_scale is None and picked.value_scale is None
    assert picked.keys.tolist() == [[[[4.0, 5.0], [6.0, 7.0]]]] and picked.positions.tolist() == [[[2, 3]]]


def test_empty_region_lives_on_the_requested_device():
    meta = torch.device("meta")  # a device other than the default CPU, available everywhere
    region = Region.empty(2, 3, 4, torch.float16, meta, ("ema",), int8=True)
    tensors = [region.keys, region.values, region.positions, region.valid, region.stats["ema"],
               region.key_scale, region.value_scale]
    assert all(t.device == meta for t in tensors)


def test_dense_is_the_deprecated_name_of_all_valid():
    region = Region.empty(1, 1, 2, torch.float32, torch.device("cpu"), (), False)
    with pytest.warns(DeprecationWarning, match="all_valid"):
        assert region.dense is True
    with pytest.warns(DeprecationWarning):
        region.dense = False
    assert region.all_valid is False


# ---------------------------------------------------------------------------------------------------
# ``Region.gather`` on INT8 data: every per-slot tensor, scales included, follows its slot.
#
# The expectation is built slot by slot with Python indexing, and the dequantized kept
# tokens must equal the dequantized originals at the chosen slots (a scale left behind or
# gathered with another slot's index changes them).


B, H, L, D = 2, 3, 10, 8


def _random_int8_region(seed: int) -> tuple[Region, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, L, D, generator=g) * torch.linspace(0.1, 5, L)[:, None]  # scales differ per slot
    values = torch.randn(B, H, L, D, generator=g) * torch.linspace(5, 0.1, L)[:, None]
    channel = quant.key_channel_scale(keys)
    q_keys, key_scale = quant.quantize_keys(keys, channel)
    q_values, value_scale = quant.quantize_values(values)
    positions = torch.arange(L).repeat(B, H, 1) + 100 * torch.arange(B)[:, None, None]
    region = Region(keys=q_keys, values=q_values, positions=positions, valid=torch.ones(B, L, dtype=torch.bool),
                    stats={"ema": torch.rand(B, H, L, generator=g)}, key_scale=key_scale, value_scale=value_scale,
                    all_valid=True)
    return region, channel


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int8_gather_moves_scales_with_their_slots(seed):
    region, channel = _random_int8_region(seed)
    g = torch.Generator().manual_seed(100 + seed)
    keep = 4
    # a different, sorted set of slots per (sequence, head), as head-wise eviction gives
    index = torch.stack([torch.stack([torch.randperm(L, generator=g)[:keep].sort().values for _ in range(H)])
                         for _ in range(B)])
    valid = torch.ones(B, keep, dtype=torch.bool)
    kept = region.gather(index, valid, all_valid=True)
    assert kept.is_int8 and kept.length == keep and kept.key_scale is not None and kept.value_scale is not None
    for b in range(B):
        for h in range(H):
            for k in range(keep):
                s = int(index[b, h, k])
                assert torch.equal(kept.keys[b, h, k], region.keys[b, h, s])
                assert torch.equal(kept.values[b, h, k], region.values[b, h, s])
                assert kept.key_scale[b, h, k] == region.key_scale[b, h, s]
                assert kept.value_scale[b, h, k] == region.value_scale[b, h, s]
                assert kept.positions[b, h, k] == region.positions[b, h, s]
                assert kept.stats["ema"][b, h, k] == region.stats["ema"][b, h, s]
    # the dequantized kept tokens are the dequantized originals at those slots
    full_keys = quant.dequantize_keys(region.keys, region.key_scale, channel)
    full_values = quant.dequantize_values(region.values, region.value_scale)
    picked = index[..., None].expand(-1, -1, -1, D)
    torch.testing.assert_close(quant.dequantize_keys(kept.keys, kept.key_scale, channel),
                               full_keys.gather(2, picked), rtol=0, atol=0)
    torch.testing.assert_close(quant.dequantize_values(kept.values, kept.value_scale),
                               full_values.gather(2, picked), rtol=0, atol=0)
    assert torch.equal(kept.valid, valid) and kept.all_valid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_take_rows_is_the_elementwise_gather_of_whole_rows(dtype):
    """take_rows (one index_select of rows) gives what ``gather`` with the index expanded over D gives: per
    head its own slots, repeats allowed, a view that is not contiguous, batch 2, and no slot at all."""
    from confkv.store.hot_tier import take_rows

    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(2, 3, 11, 10, generator=gen) * 50).to(dtype)
    t = base[:, :, :, 1:9]  # not contiguous
    for width in (0, 1, 7):
        index = torch.randint(0, 11, (2, 3, width), generator=gen)
        index[0, 0, :] = index[0, 0, :1].expand(width) if width else index[0, 0, :]  # repeats
        want = t.gather(2, index[..., None].expand(-1, -1, -1, t.shape[-1]))
        got = take_rows(t, index)
        assert got.shape == want.shape and got.dtype == dtype and torch.equal(got, want)


def test_gather_pages_of_is_gather_pages_of_each_tensor():
    """A cold tier's page tensors gathered at one index with the rows worked out once (gather_pages_of) hold what
    gather_pages gives each alone: 3-, 4- and 5-dimensional tensors of several dtypes, two page counts in one call
    (the rows worked out again), a tensor that is not contiguous, batch 2, repeated and unordered pages."""
    from confkv.attention.segments import gather_pages, gather_pages_of

    gen = torch.Generator().manual_seed(3)
    pages = {"heat": torch.rand(2, 3, 9, generator=gen), "positions": torch.randint(0, 999, (2, 3, 9, 4), generator=gen),
             "codes": torch.randint(0, 255, (2, 3, 9, 4, 6), generator=gen).to(torch.uint8),
             "other_count": torch.randn(2, 3, 12, 5, generator=gen).to(torch.bfloat16),
             "strided": torch.randn(2, 3, 9, 8, generator=gen)[..., ::2],
             "after": torch.rand(2, 3, 9, generator=gen)}  # the first count again, after the other
    index = torch.tensor([[[8, 0, 3], [2, 2, 5], [7, 6, 1]], [[1, 7, 6], [0, 4, 4], [5, 1, 8]]])
    got = gather_pages_of(pages, index)
    assert list(got) == list(pages)
    for name, tensor in pages.items():
        want = gather_pages(tensor, index)
        assert got[name].dtype == want.dtype and got[name].shape == want.shape and torch.equal(got[name], want), name
