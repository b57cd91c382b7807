"""A layer store's decode step (write the new token into the FP window, read, update the statistics) as
one C call: ``confkv_decode_step`` in ``kernels.c`` (issue "Speed", item 1: the store's per-step plumbing).

:meth:`confkv.store.LayerStore.decode_step` takes this path for the same steps as its in-place path
(dense full-precision regions, one token, nothing padded, an attention-ranked policy, on CPU). The
pointers of the window buffer and the older region change only when the store replaces one of them
(a new buffer, ageing, eviction), so a :class:`DecodePlan` holds them in a C struct built once and
each step passes only the new token, the query and the window's length.

A policy whose ``observe`` is linear per slot (``stat = stat * scale + mass * gain``, see
:meth:`confkv.policies.base.Policy.linear_observe`: CONF-KV's EMA, H2O's sum) has its statistics
updated inside the call; for the others the call returns the masses and the store calls ``observe``.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from confkv.native.loader import library

if TYPE_CHECKING:
    from confkv.store.hot_tier import Region
    from confkv.store.window_buffer import WindowBuffer

_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_STATS = 8  # MAX_STATS of kernels.c (c/mass_read.c)

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Plan(ctypes.Structure):
    """kernels.c's ``decode_plan`` (same fields, same order)."""

    _fields_ = [("B", _i64), ("Hkv", _i64), ("Hq", _i64), ("D", _i64), ("capacity", _i64), ("kv_dtype", ctypes.c_int),
                ("window_keys", _ptr), ("window_values", _ptr), ("window_positions", _ptr), ("window_valid", _ptr),
                ("old_keys", _ptr), ("old_values", _ptr), ("old_length", _i64), ("old_key_strides", _i64 * 3),
                ("old_value_strides", _i64 * 3), ("n_stats", ctypes.c_int), ("linear", ctypes.c_int),
                ("window_stats", _ptr * MAX_STATS),
                ("old_stats", _ptr * MAX_STATS), ("stat_scale", _f32 * MAX_STATS), ("stat_gain", _f32 * MAX_STATS)]


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.confkv_decode_step
    if fn.argtypes is None:
        i32 = ctypes.c_int
        fn.restype = i32
        fn.argtypes = [ctypes.POINTER(_Plan), _ptr, i32, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64,
                       _f32, _ptr, _ptr, _ptr, i32]


def _no_plan() -> None:
    return None


class DecodePlan:
    """One layer's window buffer and older region as the C call's struct.

    Args:
        window: the FP window's buffer (keys / values [B, Hkv, C, D], contiguous).
        old: the older region (keys / values [B, Hkv, L_old, D], full precision, any strides with a
            contiguous last dimension; statistics [B, Hkv, L_old] contiguous).
        q_heads: Hq, a multiple of Hkv.
        linear: stat name -> (scale, gain) when the policy's observe is linear (every statistic of the
            regions listed), or None: the call returns the masses.
    """

    def __init__(self, lib: ctypes.CDLL, window: WindowBuffer, old: Region, q_heads: int,
                 linear: dict[str, tuple[float, float]] | None) -> None:
        # weak references: a plan must not keep a replaced buffer or region alive (their bytes are no longer counted)
        self.lib, self.window_ref, self.old_ref = lib, weakref.ref(window), weakref.ref(old)
        self.old_keys_ptr, self.old_length = old.keys.data_ptr(), old.length
        self.linear = linear
        batch, kv_heads, capacity, head_dim = window.keys.shape
        plan = _Plan(B=batch, Hkv=kv_heads, Hq=q_heads, D=head_dim, capacity=capacity,
                     kv_dtype=_CODES[window.keys.dtype], window_keys=window.keys.data_ptr(),
                     window_values=window.values.data_ptr(), window_positions=window.positions.data_ptr(),
                     window_valid=window.valid.data_ptr(), old_keys=old.keys.data_ptr(),
                     old_values=old.values.data_ptr(), old_length=old.length)
        plan.old_key_strides[:] = old.keys.stride()[:3]
        plan.old_value_strides[:] = old.values.stride()[:3]
        plan.n_stats, plan.linear = len(window.stats), int(bool(linear))
        for k, name in enumerate(window.stats):
            plan.window_stats[k] = window.stats[name].data_ptr()
            plan.old_stats[k] = old.stats[name].data_ptr()
            plan.stat_scale[k], plan.stat_gain[k] = linear[name] if linear else (1.0, 0.0)
        self.plan = plan
        self.plan_ref = ctypes.byref(plan)

    def __deepcopy__(self, memo: dict) -> None:
        """None: a plan holds the original's pointers (and ctypes objects, which cannot be copied); a copied store
        (``ConfKVCache.clone``) builds its own at its next decode step."""
        return None

    def __reduce__(self) -> tuple:
        return (_no_plan, ())  # pickled as None, for the same reason

    @classmethod
    def build(cls, window: WindowBuffer, old: Region, q_heads: int,
              linear: dict[str, tuple[float, float]] | None) -> "DecodePlan | None":
        """A plan, or None when the library is off or a tensor's layout or dtype is not the call's."""
        lib = library()
        if lib is None or window.keys.dtype not in _CODES or old.keys.dtype != window.keys.dtype:
            return None
        if old.values.dtype != window.keys.dtype or old.key_scale is not None or q_heads % window.keys.shape[1]:
            return None
        if not all(t.is_contiguous() for t in (window.keys, window.values, window.positions, window.valid)):
            return None
        if window.positions.dtype != torch.int64 or window.valid.dtype != torch.bool:
            return None
        if (old.length and (old.keys.stride(-1) != 1 or old.values.stride(-1) != 1)) or old.keys.shape[:2] != window.keys.shape[:2]:
            return None
        names = set(window.stats)
        if len(names) > MAX_STATS or names != set(old.stats) or not all(
                t.dtype == torch.float32 and t.is_contiguous() for name in names for t in (window.stats[name], old.stats[name])):
            return None
        if linear is not None and set(linear) != names:
            linear = None
        _declare(lib)
        return cls(lib, window, old, q_heads, linear)

    def serves(self, window: WindowBuffer, old: Region) -> bool:
        """Whether this plan's pointers are still those of ``window`` and ``old`` (the store replaces them whole;
        the caller holds both, so the pointers are valid while it calls :meth:`step`)."""
        return window is self.window_ref() and old is self.old_ref() and old.keys.data_ptr() == self.old_keys_ptr

    def step(self, query: Tensor, keys: Tensor, values: Tensor, position: Tensor, length: int,
             scaling: float) -> tuple[Tensor, list[Tensor] | None]:
        """Write the new token at slot ``length`` and read: query [B, Hq, 1, D], keys / values [B, Hkv, 1, D]
        (the window's dtype, last dimension contiguous), position [B] int64 contiguous ->
        (out [B, Hq, 1, D] in query.dtype, None when the statistics were updated here, else the masses
        [B, Hkv, L_old] and [B, Hkv, length + 1] float32 for the policy's observe)."""
        batch, q_heads, _, head_dim = query.shape
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(batch, q_heads, 1, head_dim, dtype=query.dtype)
        if self.linear:
            masses, old_ptr, window_ptr = None, None, None
        else:
            kv_heads = keys.shape[1]
            masses = [torch.empty(batch, kv_heads, self.old_length, dtype=torch.float32),
                      torch.empty(batch, kv_heads, length + 1, dtype=torch.float32)]
            old_ptr, window_ptr = masses[0].data_ptr(), masses[1].data_ptr()
        qs, ks, vs = query.stride(), keys.stride(), values.stride()
        status = self.lib.confkv_decode_step(
            self.plan_ref, query.data_ptr(), _CODES[query.dtype], qs[0], qs[1], keys.data_ptr(), ks[0], ks[1],
            values.data_ptr(), vs[0], vs[1], position.data_ptr(), length, scaling, out.data_ptr(), old_ptr,
            window_ptr, torch.get_num_threads())
        if status:
            raise MemoryError("confkv native decode step: out of memory for the scores") if status == 1 else \
                RuntimeError(f"confkv native decode step: slot {length} is outside the window's "
                             f"{self.plan.capacity} slots (the store and its plan are out of step)")
        return out, masses
