"""The few-op read's dispatch rule and its error, checked against hand-worked limits.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md). The size
checks use expanded zero tensors: their shapes are large but they own one element, so
no score row is ever materialised.
"""

from __future__ import annotations

import pytest
import torch

from confkv.attention import KVSegment
from confkv.attention.mass_read import MAX_SCORES, mass_read, mass_read_eligible


def _segment(length: int, kv_heads: int = 1, head_dim: int = 4) -> KVSegment:
    zero = torch.zeros(1, 1, 1, 1).expand(1, kv_heads, length, head_dim)
    return KVSegment(zero, zero, None)


def _query(batch: int, heads: int, queries: int, dtype: torch.dtype = torch.float32,
           device: str = "cpu") -> torch.Tensor:
    return torch.zeros(1, 1, 1, 1, dtype=dtype, device=device).expand(batch, heads, queries, 4)


@pytest.mark.parametrize("batch, heads, queries", [(1, 2, 1), (1, 1, 2), (2, 1, 1), (2, 2, 2)])
def test_the_score_limit_counts_batch_times_heads_times_queries_times_slots(batch, heads, queries):
    """B * Hq * Q * L scores: exactly MAX_SCORES still fits, one slot more does not."""
    rows = batch * heads * queries
    fits = MAX_SCORES // rows  # slots in total, split over two segments
    assert mass_read_eligible(_query(batch, heads, queries), [_segment(fits - 5), _segment(5)], None)
    assert not mass_read_eligible(_query(batch, heads, queries), [_segment(fits - 4), _segment(5)], None)


def test_only_a_floating_point_query_on_the_cpu_is_eligible():
    segments = [_segment(3)]
    assert mass_read_eligible(_query(1, 1, 1), segments, None)
    assert not mass_read_eligible(_query(1, 1, 1, dtype=torch.int64), segments, None)
    assert not mass_read_eligible(_query(1, 1, 1, device="meta"), segments, None)
    assert not mass_read_eligible(_query(1, 1, 1), segments, 30.0)  # a soft-cap takes the block-wise read


def test_query_heads_not_a_multiple_of_the_kv_heads_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^Hq=4 is not a multiple of Hkv=3$"):
        mass_read(torch.zeros(1, 4, 1, 4), [_segment(2, kv_heads=3)], 0.5)
