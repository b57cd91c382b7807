"""Which backend an attention read takes, decided in one place (issue 32), and the read:
:func:`attention_read` plans, then calls the backend the plan names.

:func:`plan` looks at the query, the segments and the settings and names the path:

==================  ===========================================================================
``triton``          CUDA query with ``triton``: the Triton read (packed pages read in its kernel)
``fused``           PyTorch's fused CPU kernel (no mask, no mass, full precision, no pages)
``native_prefill``  :func:`confkv.native.prefill.prefill_read`: a prefill chunk's many rows over dense segments
                    (packed pages dequantized first), masks and the mass in one C call (AVX512-BF16 products)
``native_mass``     :func:`confkv.native.mass_read`: mass needed, every slot visible, no pages
``native_pages``    :func:`confkv.native.page_entry.page_read`: masks and packed KIVI pages in one C call
``mass``            :func:`confkv.attention.mass_read.mass_read` (torch), the native library missing
``torch``           the block-wise torch read, packed pages gathered and dequantized first
==================  ===========================================================================

Every plan that leaves the native path on CPU (``mass``, ``torch``) carries the reason, and
:func:`confkv.attention.attention_read` counts it with :func:`confkv.profiling.left_native`, so a
store that falls to the slow read is seen (``confkv bench --breakdown-steps`` prints the counts).
:func:`hands_pages` tells a store whether to hand its cold pages over still packed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from confkv import native, profiling
from confkv.attention import fused_cpu
from confkv.attention.blockwise import DEFAULT_BLOCK_SIZE, blockwise_attention
from confkv.attention.fused_cpu import fused_read_eligible
from confkv.attention.mass_read import MAX_SCORES, mass_read, mass_read_eligible
from confkv.attention.segments import KVSegment, PagedSegment, densify
from confkv.native import page_entry
from confkv.native import pages as native_pages
from confkv.native import prefill as native_prefill

BACKENDS = ("auto", "torch", "fused", "triton")
#: the paths that are not a fallback
FAST = ("triton", "fused", "native_prefill", "native_mass", "native_pages")
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class ReadPlan:
    """A read's path (see the module docstring) and, when it left the native path, why."""

    path: str
    reason: str | None = None


def triton_reads(query: Tensor, backend: str) -> bool:
    """True when the read runs the Triton kernel (``backend="triton"``, or ``auto`` with a CUDA query and triton)."""
    if backend == "triton":
        return True
    if backend != "auto" or not query.is_cuda:
        return False
    from confkv.attention import triton_read

    return triton_read.triton_available()


def hands_pages(query: Tensor, backend: str) -> bool:
    """Whether a cold tier should hand its selected pages over still packed (a :class:`PagedSegment`):
    the Triton read, or ``auto`` on CPU with the native kernels (the native page read takes them)."""
    if triton_reads(query, backend):
        return True
    return backend == "auto" and query.device.type == "cpu" and native.available()


def _dense_reason(query: Tensor, segments: Sequence, softcap: float | None) -> str:
    """Why a read without packed pages is not a native mass read (it was not eligible)."""
    if softcap is not None:
        return "softcap"
    if any(s.keys_int8 or s.values_int8 for s in segments):
        return "INT8 segment"
    if any(s.visible is not None for s in segments):
        return "masked segment without packed pages"
    if native_pages.score_entries(query, segments) > MAX_SCORES:
        return "scores over MAX_SCORES"
    return "segments the mass read does not take"


def plan(query: Tensor, segments: Sequence, softcap: float | None, need_mass: bool, backend: str) -> ReadPlan:
    """The path of ``attention_read(query, segments, ..., backend=backend)`` (see the module docstring).

    Raises ValueError for an unknown backend, and for ``backend="fused"`` on a read it does not take.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    has_pages = any(isinstance(s, PagedSegment) for s in segments)
    if triton_reads(query, backend):
        if has_pages and any(s.rotation is not None for s in segments if isinstance(s, PagedSegment)):
            return ReadPlan("torch", "rotated pages (the Triton read takes none)")
        if has_pages and not all(s.plain for s in segments if isinstance(s, PagedSegment)):
            return ReadPlan("torch", "pages of two widths or with outliers (the Triton read takes neither)")
        return ReadPlan("triton")
    if backend in ("auto", "fused") and not has_pages and fused_read_eligible(query, segments, softcap, need_mass):
        return ReadPlan("fused")
    if backend == "fused":
        raise ValueError("backend 'fused' needs a CPU query, full-precision segments of its dtype, no mask, "
                         "no softcap and need_mass=False; use backend='auto' to fall back to the block-wise read")
    if backend == "torch":
        return ReadPlan("torch", "backend 'torch' asked")
    if query.device.type != "cpu":
        return ReadPlan("torch", "GPU query without triton")
    mass_eligible = not has_pages and need_mass and mass_read_eligible(query, segments, softcap)
    if not native.available():
        return ReadPlan("mass" if mass_eligible else "torch", "native kernels unavailable")
    if not has_pages:
        if native_prefill.eligible(query, segments, softcap):
            return ReadPlan("native_prefill")
        if mass_eligible:
            if query.dtype in _NATIVE_DTYPES and all(s.keys.dtype in _NATIVE_DTYPES and s.values.dtype in
                                                     _NATIVE_DTYPES for s in segments):
                return ReadPlan("native_mass")
            return ReadPlan("mass", "dtype the native mass read does not take")
        if not need_mass:
            return ReadPlan("torch", "no mass needed, not fused-eligible")
        return ReadPlan("torch", _dense_reason(query, segments, softcap))
    if native_prefill.eligible(query, segments, softcap):  # a prefill chunk: its many rows read pages dequantized
        return ReadPlan("native_prefill")
    if softcap is not None:
        return ReadPlan("torch", "softcap")
    why = page_entry.unsupported(query, segments)
    if why is not None:
        return ReadPlan("torch", why)
    if native_pages.score_entries(query, segments) > MAX_SCORES:
        return ReadPlan("torch", "scores over MAX_SCORES")
    return ReadPlan("native_pages")


def page_reader(query: Tensor, segments: Sequence, softcap: float | None, need_mass: bool,
                backend: str) -> "native_pages.PageReader | None":
    """The native page read for reads like this one, when :func:`plan` sends them there (checked now, once), else
    None: such reads go through :func:`attention_read`, which plans each and counts a fallback with its reason.
    A store asks this when the kind of its read changes (:meth:`confkv.store.read.AttentionRead._tiered_read`)."""
    if plan(query, segments, softcap, need_mass, backend).path != "native_pages":
        return None
    return native_pages.PageReader(native.library(), page_entry.rotation_matrix(segments))


def reads_pages(query: Tensor, backend: str) -> bool:
    """True when ``attention_read(query, ..., backend=backend)`` runs the Triton read, which
    takes a :class:`PagedSegment` without a host-side gather + dequantize (the native page read
    takes them too: :func:`hands_pages` asks both)."""
    return triton_reads(query, backend)


def attention_read(
    query: Tensor,
    segments: Sequence[KVSegment | PagedSegment],
    scaling: float,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softcap: float | None = None,
    need_mass: bool = True,
    backend: str = "auto",
) -> tuple[Tensor, list[Tensor] | None]:
    """Run the read on the path :func:`plan` names; same contract as
    :func:`blockwise_attention`.

    Args:
        backend: "torch" (the block-wise reference, always available), "fused"
            (PyTorch's fused CPU kernel; raises unless
            :func:`~confkv.attention.fused_cpu.fused_read_eligible`), "triton" (CUDA
            tensors and the ``triton`` package required; raises otherwise), or "auto":
            triton when the query is on CUDA and triton imports, else fused where
            eligible, else (the mass needed) :func:`mass_read` where eligible (in its native
            version, :func:`confkv.native.mass_read`, when available), else, with packed pages,
            the native page read (:func:`confkv.native.page_entry.page_read`), else torch.
            ``block_size`` only applies to the torch backend.
            The torch paths read a :class:`PagedSegment` via its ``to_dense``.
    A plan that leaves the native path is counted with its reason (:func:`confkv.profiling.left_native`).
    """
    chosen = plan(query, segments, softcap, need_mass, backend)
    if chosen.reason is not None:
        profiling.left_native(chosen.reason)
    path = chosen.path
    if path == "triton":
        from confkv.attention.triton_read import triton_attention

        return triton_attention(query, segments, scaling, softcap=softcap, need_mass=need_mass)
    if path == "native_pages":
        fast_pages = page_entry.page_read(query, segments, scaling, need_mass)
        if fast_pages is not None:
            return fast_pages
        profiling.left_native("native page read declined")
        path = "torch"
    segments = densify(list(segments))  # the torch paths and the prefill read take packed pages dequantized
    if path == "native_prefill":
        fast_prefill = native_prefill.prefill_read(query, segments, scaling, need_mass)
        if fast_prefill is not None:
            return fast_prefill
        profiling.left_native("native prefill read declined")
        path = "torch"
    if path == "fused":
        return fused_cpu.fused_attention(query, segments, scaling), None
    if path == "native_mass":
        fast = native.mass_read(query, segments, scaling)
        if fast is not None:
            return fast
        profiling.left_native("native mass read declined")
        path = "mass"
    if path == "mass":
        return mass_read(query, segments, scaling)
    return blockwise_attention(query, segments, scaling, block_size, softcap=softcap, need_mass=need_mass)
