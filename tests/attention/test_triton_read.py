"""Triton read == block-wise torch read, run in Triton's CPU interpreter (TRITON_INTERPRET=1).

On a CUDA machine the same comparisons also run compiled (marked ``gpu``).
"""

from __future__ import annotations

import os

# The kernel is jitted lazily, on first call; the interpreter flag must be set by then.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from confkv.attention import attention_read  # noqa: E402
from confkv.attention import triton_read  # noqa: E402
from confkv.attention.blockwise import dense_attention_reference  # noqa: E402

from segment_cases import attention_cases, make_segment  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_read.triton_available(), reason="optional 'triton' package not installed")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _check(query, segments, softcap=None, **kwargs):
    scaling = query.shape[-1] ** -0.5
    out, mass = triton_read.triton_attention(query, segments, scaling, softcap=softcap, **kwargs)
    ref_out, ref_mass = dense_attention_reference(query, segments, scaling, softcap)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out, ref_out.to(out.device), atol=3e-5, rtol=1e-4)
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got, want.to(got.device), atol=3e-5, rtol=1e-4)
    out_no_mass, none = triton_read.triton_attention(query, segments, scaling, softcap=softcap, need_mass=False, **kwargs)
    assert none is None
    torch.testing.assert_close(out_no_mass, out, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter run (TRITON_INTERPRET=1)")
@settings(max_examples=12, deadline=None)
@given(case=attention_cases(max_length=40), softcap=st.sampled_from([None, 5.0]), split_blocks=st.integers(1, 2))
def test_interpreted_matches_dense(case, softcap, split_blocks):
    """Random shapes, int8/fp segments, masks (incl. fully masked rows), several splits."""
    query, segments = case
    _check(query, segments, softcap, split_size=16 * split_blocks, block_n=16)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter run (TRITON_INTERPRET=1)")
def test_interpreted_smollm_decode_shape():
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 9, 1, 64, generator=gen)
    segments = [
        make_segment(gen, 2, 3, 70, 64, 1, int8=True, mask_kind="none"),
        make_segment(gen, 2, 3, 20, 64, 1, int8=False, mask_kind="random"),
    ]
    _check(query, segments, split_size=32, block_n=16)


def test_large_query_blocks_fall_back_to_torch():
    if not INTERPRETED:
        pytest.skip("CPU tensors need the interpreter")
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, 40, 8, generator=gen)  # G*Q = 80 rows > MAX_ROWS
    segments = [make_segment(gen, 1, 2, 9, 8, 40, int8=True, mask_kind="per_query")]
    _check(query, segments)


def test_errors(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(1, 2, 1, 8, generator=gen)
    segments = [make_segment(gen, 1, 1, 5, 8, 1, int8=True, mask_kind="none")]
    with pytest.raises(ValueError):
        triton_read.triton_attention(query, segments, 0.3, block_n=24)
    # CPU tensors without the interpreter: a clear error, and "auto" stays on torch
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA"):
        attention_read(query, segments, 0.3, backend="triton")
    out, _ = attention_read(query, segments, 0.3, backend="auto")
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_compiled_on_gpu_matches_torch(dtype):
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, 9, 1, 64, generator=gen)
    segments = [
        make_segment(gen, 2, 3, 1000, 64, 1, int8=True, mask_kind="none"),
        make_segment(gen, 2, 3, 33, 64, 1, int8=False, mask_kind="random", dtype=dtype),
    ]
    cuda_segments = [
        type(s)(*(None if t is None else t.cuda() for t in (s.keys, s.values, s.visible, s.key_token_scale, s.key_channel_scale, s.value_token_scale)))
        for s in segments
    ]
    out, mass = attention_read(query.cuda().to(dtype), cuda_segments, 0.125, backend="auto")
    ref_out, ref_mass = dense_attention_reference(query.to(dtype), segments, 0.125)
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(out.cpu(), ref_out, atol=tol, rtol=tol)
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-3)
