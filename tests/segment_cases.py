"""Random attention-read inputs shared by the attention-read tests (block-wise, fused CPU, Triton).

Shapes: query (batch, kv_heads * group, num_queries, dim); each segment's keys/values
(batch, kv_heads, length, dim), optionally INT8 with per-token / per-channel scales.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from confkv.attention import KVSegment
from confkv.quant import key_channel_scale, quantize_keys, quantize_values


def make_segment(
    gen: torch.Generator,
    batch: int,
    kv_heads: int,
    length: int,
    dim: int,
    num_queries: int,
    int8: bool,
    mask_kind: str,
    dtype: torch.dtype = torch.float32,
) -> KVSegment:
    """A random segment; ``mask_kind`` in {"none", "random", "per_query", "hidden"}."""
    keys = torch.randn(batch, kv_heads, length, dim, generator=gen) * 2
    if dim > 1:
        keys[..., 1] *= 8  # an outlier key channel
    values = torch.randn(batch, kv_heads, length, dim, generator=gen)
    if mask_kind == "none":
        visible = None
    elif mask_kind == "random":
        visible = torch.rand(batch, kv_heads, num_queries, length, generator=gen) < 0.6
    elif mask_kind == "per_query":  # broadcast over batch and heads, like a causal mask
        visible = torch.rand(num_queries, length, generator=gen) < 0.5
    else:  # nothing visible in this segment
        visible = torch.zeros(1, 1, 1, length, dtype=torch.bool)
    if not int8:
        return KVSegment(keys.to(dtype), values.to(dtype), visible)
    channel = key_channel_scale(keys)
    key_q, key_ts = quantize_keys(keys, channel)
    value_q, value_ts = quantize_values(values)
    return KVSegment(key_q, value_q, visible, key_ts, channel, value_ts)


def unmasked_segments(lengths, batch=2, kv_heads=3, dim=16, num_queries=1, dtype=torch.float32, seed=0):
    """Full-precision segments of the given lengths, every slot visible (the fused and mass reads' case)."""
    gen = torch.Generator().manual_seed(seed)
    return [make_segment(gen, batch, kv_heads, n, dim, num_queries, False, "none", dtype) for n in lengths]


@st.composite
def attention_cases(draw, max_length: int = 12):
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 4))
    num_queries = draw(st.integers(1, 5))
    dim = draw(st.sampled_from([1, 8, 16]))
    specs = draw(
        st.lists(
            st.tuples(
                st.integers(0, max_length),
                st.booleans(),
                st.sampled_from(["none", "random", "per_query", "hidden"]),
            ),
            min_size=1,
            max_size=3,
        )
    )
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * group, num_queries, dim, generator=gen)
    segments = [make_segment(gen, batch, kv_heads, length, dim, num_queries, int8, mask) for length, int8, mask in specs]
    return query, segments
