"""The attention read of a layer store's step: :meth:`~AttentionRead.attend` after an ``append`` (any step,
prefill chunks and padding included) and :meth:`~AttentionRead.decode_step` (one token per sequence, written
into the FP window's spare slots and read at once where it can).

The read walks the older region, the FP window and, with a cold tier, the pages the policy's read budget
selects (:mod:`confkv.tiers.cold`), and hands the attention mass to the policy's statistics. Its state is the
store's (:class:`confkv.store.layer.LayerStore`, which is this class plus what the store keeps: see there);
the two are one class split by job, so each file reads on its own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch.nn.functional import pad

from confkv import native, profiling
from confkv.attention import KVSegment, attention_read
from confkv.attention.read_plan import hands_pages, page_reader, triton_reads
from confkv.attention.mass_read import MAX_SCORES, mass_read
from confkv.config import ALL_PAGES, StoreConfig
from confkv.native import loader
from confkv.native import pages as native_pages
from confkv.native.decode import DecodePlan
from confkv.store.hot_tier import Region
from confkv.store.window_buffer import WindowBuffer
from confkv.tiers.ladder import LadderTier

if TYPE_CHECKING:
    from confkv.tiers.cold import ColdTier
    from confkv.policies.base import Policy
    from confkv.tiers.storage import Storage


class ReadRoute:
    """What a store with a cold tier decided for its reads of one signature (issue 32: the read path is decided once
    per store, when the kind of its read changes, not at every step): ``reader``, the native page read to call, or
    None (each read goes through ``attention_read``, which plans it and counts the fallback). ``kept``: the objects
    whose identity the signature names (the pages' rotations), held so that no other object takes their ``id``.

    A copied store (``ConfKVCache.clone``) starts without one (the reader holds the library's handle)."""

    __slots__ = ("signature", "reader", "kept")

    def __init__(self, signature: tuple, reader: native_pages.PageReader | None, kept: list) -> None:
        self.signature, self.reader, self.kept = signature, reader, kept

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (type(None), ())  # pickled as None, for the same reason


class AttentionRead:
    """The read half of :class:`~confkv.store.layer.LayerStore`: its attributes are documented there, and the
    read calls four of its members (``append``, ``is_initialized``, ``physical_length``, ``_promote``)."""

    policy: Policy
    config: StoreConfig
    storage: Storage | None
    sliding_window: int | None
    int8: bool
    stat_names: tuple[str, ...]
    old: Region | None
    recent: Region | None
    channel_scale: torch.Tensor | None
    seen_tokens: int
    seen_real: torch.Tensor | None
    pending: int
    cold: ColdTier | LadderTier | None
    cold_read: torch.Tensor | None
    window: WindowBuffer | None
    decode_plan: DecodePlan | None
    read_route: ReadRoute | None
    page_handling: tuple | None

    def decode_step(self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, *, scaling: float) -> torch.Tensor:
        """:meth:`append` then :meth:`attend` of one new token per sequence, nothing padded, the same state
        and output: keys and values [B, Hkv, 1, D], query [B, Hq, 1, D] -> [B, Hq, 1, D].

        The common decode step of an attention-ranked policy on CPU (full-precision all-valid regions, the
        native mass read) writes its token into the FP window's preallocated slots and reads at once,
        as one C call where it can (:meth:`_decode_in_place`); a step with every window slot valid otherwise
        appends and places its token in fewer calls (:meth:`_append_one`); any other runs the two calls.
        """
        if self.can_decode_in_place(keys, query):
            return self._decode_in_place(keys, values, query, scaling)
        if self.is_initialized and not self.pending and keys.shape[2] == 1 == query.shape[2] and \
                self.recent.all_valid and keys.dtype == self.recent.keys.dtype and self.seen_real.dtype == torch.int64:
            return self._attend_placed(query, self._append_one(keys, values), scaling, None)
        self.append(keys, values)
        return self.attend(query, scaling=scaling)

    def _append_one(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``append`` of one token per sequence (keys / values [B, Hkv, 1, D]) and the positions ``attend`` gives it
        when nothing is padded, in fewer calls (a decode step of a store that does not decode in place, as under a
        memory target: the same region, every slot valid); returns the query positions [B, 1]."""
        with profiling.section("append (FP window)"):
            recent, (batch, kv_heads) = self.recent, keys.shape[:2]
            position = self.seen_real.view(batch, 1, 1).expand(batch, kv_heads, 1)
            self.recent = Region(keys=torch.cat([recent.keys, keys], dim=2),
                                 values=torch.cat([recent.values, values], dim=2),
                                 positions=torch.cat([recent.positions, position], dim=2),
                                 valid=recent.valid.new_ones(batch, recent.length + 1), all_valid=True,
                                 stats={name: pad(t, (0, 1)) for name, t in recent.stats.items()})  # zero statistics
            self.window = None  # the recent region is a fresh copy now
            query_positions, self.seen_real = self.seen_real[:, None], self.seen_real + 1
            self.seen_tokens += 1
            self.last_queries = 1
        return query_positions

    def can_decode_in_place(self, keys: torch.Tensor, query: torch.Tensor) -> bool:
        """Whether this decode step may be taken in place: one initialised, non-pending token of a full-precision
        store without a cold tier or a sliding window, all-valid regions, a policy that needs the attention mass, and
        the conditions under which ``attention_read`` would take the mass read (``auto`` backend, CPU, scores that
        fit).

        ``attention_read``'s dispatch must stay in step with this test; ``tests/store/test_window_buffer.py`` compares the
        two paths' logits and state."""
        if not self.is_initialized or self.pending or keys.shape[2] != 1 or query.shape[2] != 1:
            return False
        if self.cold is not None or self.sliding_window is not None or self.int8 or not self.stat_names:
            return False
        if self.storage is not None:  # under a memory target: no spare window slots beyond the planned bytes
            return False
        if not (self.old.all_valid and self.recent.all_valid and self.policy.needs_attention):
            return False
        if self.config.read_backend != "auto" or query.device.type != "cpu" or keys.dtype != self.recent.keys.dtype:
            return False
        return query.shape[0] * query.shape[1] * (self.physical_length + 1) <= MAX_SCORES

    def _decode_in_place(self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
                         scaling: float) -> torch.Tensor:
        """The in-place decode step (the caller checked :meth:`can_decode_in_place`): the new token written into
        the FP window's preallocated slots (:class:`WindowBuffer`, made with ``move_block`` + 1 spare slots when
        the window has none left; its bytes are counted by ``kv_bytes``) and read at once.

        Where the native library takes the layer's tensors, the write, the mass read and, for a policy with a
        linear statistics update, the update are one C call (:class:`confkv.native.decode.DecodePlan`);
        otherwise the window's :meth:`~WindowBuffer.append_one`, the mass read and the policy's ``observe`` run
        in Python. Either way the state and the output equal ``append`` + ``attend``."""
        window, length = self.window, self.recent.length
        if window is None or length >= window.capacity or not window.backs(self.recent):
            self.window = window = WindowBuffer.around(self.recent, length + self.config.move_block + 1)
        plan = self.decode_plan
        if plan is None or not plan.serves(window, self.old):
            plan = self.decode_plan = DecodePlan.build(window, self.old, query.shape[1], self.policy.linear_observe(1))
        if (plan is not None and query.dtype == keys.dtype and keys.stride(-1) == 1 and values.stride(-1) == 1
                and self.seen_real.dtype == torch.int64):
            with profiling.section("native decode step"):
                out, masses = plan.step(query, keys, values, self.seen_real.contiguous(), length, scaling)
                self.recent = window.views(length + 1)
                self.seen_real = self.seen_real + 1
                self.seen_tokens += 1
                if masses is not None:
                    for region, mass in zip((self.old, self.recent), masses):
                        self.policy.observe(region.stats, mass, 1)
            return out
        with profiling.section("append (FP window)"):
            self.recent = window.append_one(length, keys, values, self.seen_real)
            self.seen_real = self.seen_real + 1
            self.seen_tokens += 1
            regions = [r for r in (self.old, self.recent) if r.length]
        with profiling.section("attention read"):
            segments = [KVSegment(r.keys, r.values, None) for r in regions]
            read = native.mass_read(query, segments, scaling)
            out, masses = read if read is not None else mass_read(query, segments, scaling)
        with profiling.section("EMA / stats update"):
            for region, mass in zip(regions, masses):
                self.policy.observe(region.stats, mass, 1)
        return out

    def _place_new_tokens(self, padding: torch.Tensor | None) -> torch.Tensor:
        """Set positions/validity of the pending tokens; return query positions [B, q]."""
        new = self.last_queries = self.pending
        device = self.recent.keys.device
        if padding is None:
            # nothing padded: positions continue from seen_real, validity stays all True
            query_positions = self.seen_real[:, None] + torch.arange(new, device=device)  # [B, q]
            self.recent.positions[:, :, -new:] = query_positions[:, None, :]
            self.seen_real = self.seen_real + new
            self.pending = 0
            return query_positions
        real = padding[:, -new:].to(device=device, dtype=torch.bool)
        query_positions = self.seen_real[:, None] + real.long().cumsum(-1) - 1  # [B, q]
        self.recent.positions[:, :, -new:] = query_positions[:, None, :]
        self.recent.valid[:, -new:] = real
        self.recent.all_valid = False
        self.seen_real = self.seen_real + real.sum(-1)
        self.pending = 0
        return query_positions

    def _visible(self, region: Region, query_positions: torch.Tensor, causal: bool) -> torch.Tensor | None:
        """[B, 1 or Hkv, q or 1, L] bool: which slots each query may attend (None: all of them)."""
        if region.all_valid and not causal and self.sliding_window is None:
            return None
        visible = region.valid[:, None, None, :]
        if causal:
            visible = visible & (region.positions[:, :, None, :] <= query_positions[:, None, :, None])
        if self.sliding_window is not None:
            visible = visible & (query_positions[:, None, :, None] - region.positions[:, :, None, :] < self.sliding_window)
        return visible

    def attend(self, query: torch.Tensor, *, scaling: float, padding: torch.Tensor | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """Attention of this pass's queries over everything kept, new tokens included.

        Args:
            query: [B, Hq, q, D] (after RoPE), ``q`` equal to the tokens just appended.
            scaling: score scale (usually ``D ** -0.5``).
            padding: [B, >= q] bool, True for real tokens (HF's 2D attention mask; only the
                last ``q`` columns are used), or None when nothing is padded.
            softcap: Gemma-2-style score soft-capping, or None.
        Returns:
            [B, Hq, q, D] attention output in ``query.dtype``.
        """
        new = self.pending
        if new != query.shape[2]:
            raise RuntimeError(f"confkv: {query.shape[2]} queries but {new} new keys in this layer; "
                               "the cache and the attention read are out of step")
        with profiling.section("positions and masks"):
            query_positions = self._place_new_tokens(padding)
        return self._attend_placed(query, query_positions, scaling, softcap)

    def _attend_placed(self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float,
                       softcap: float | None) -> torch.Tensor:
        """:meth:`attend` once the new tokens' positions are placed (``query_positions`` [B, q])."""
        new = query.shape[2]
        with profiling.section("positions and masks"):
            regions = [r for r in (self.old, self.recent) if r.length]  # the old region may still be empty
            segments = [self._segment(r, self._visible(r, query_positions, causal=r is self.recent and new > 1))
                        for r in regions]
            need_mass = bool(self.stat_names) and self.policy.needs_attention
        rotation = None
        if self.cold is not None:  # every cold token is older than every query: no causal mask
            paged, turns_pages = self._page_handling(query)
            if any(r.is_int8 for r in regions):  # read dequantized (a few hundred tokens): the page reads take floats
                segments = [s.to_float() for s in segments]
            rotation = self.cold.read_rotation(turns_pages)
            if rotation is not None:
                segments = [KVSegment(rotation.forward(s.keys), rotation.forward(s.values), s.visible)
                            for s in segments]
            segments += self.cold.segments(query, self._cold_read_pages(), paged=paged,
                                           rotated=rotation is not None)  # timed inside
        read_query = query if rotation is None else rotation.forward(query)
        window = self.policy.observation_window() if need_mass and new > 1 else None  # (a decode step: all of one)
        observed = new if window is None or new <= window else window  # the queries whose attention is observed
        updates = self._updates_in_place(regions, segments, observed) if need_mass and observed == new else None
        with profiling.section("attention read"):
            out, masses, updated = self._read(read_query, segments, scaling, softcap, need_mass and observed == new,
                                              updates)
            if observed < new:  # the pass's last `observed` queries again, for their masses alone
                hot = len(regions)
                last = [replace(s, visible=s.visible[:, :, -observed:]) if s.visible is not None
                        and s.visible.shape[2] == new else s for s in segments[:hot]] + segments[hot:]
                masses = self._read(read_query[:, :, -observed:], last, scaling, softcap, True, None)[1]
        if rotation is not None:
            out = rotation.inverse(out).to(query.dtype)
        if need_mass:
            with profiling.section("EMA / stats update"):
                if not updated:  # else the read updated the statistics and the page heat itself
                    for region, mass in zip(regions, masses):
                        self.policy.observe(region.stats, mass, observed)
                cold_read = self.cold is not None and len(masses) > len(regions)
                if cold_read and not updated:
                    self.cold.observe_read(masses[len(regions):])
                if cold_read and self.cold.config.promote is not None and new == 1:
                    self._promote(masses[-1])
        return out

    def _page_handling(self, query: torch.Tensor) -> tuple[bool, bool]:
        """(paged, turns_pages) for this store's reads, decided once per query device, backend and library state.

        paged: the cold tier hands its selected pages over still packed (the Triton and the native page read take
        them). turns_pages: the native page read turns the query into a rotated format's basis itself; otherwise
        (confkv.tiers.hadamard) the read is in the pages' basis, so the few hot keys / values, the query and the
        output turn instead of the pages, token by token."""
        key = (loader.generation, query.device, self.config.read_backend)
        if self.page_handling is None or self.page_handling[0] != key:
            paged = hands_pages(query, self.config.read_backend)
            self.page_handling = (key, paged, paged and not triton_reads(query, self.config.read_backend))
        return self.page_handling[1], self.page_handling[2]

    def _updates_in_place(self, regions: list[Region], segments: list, observed: int) -> list | None:
        """What a native page read may update in place from this read's masses, one entry per segment (the
        regions' then the cold tier's): each region's statistic when the policy's update is linear and one
        statistic (``linear_observe``), and the page heat the cold tier's ``observe_read`` would add; None when not
        every one of them can be (then all stay with the Python below the read). It runs in every layer of every
        decode step, so the float32 bits of the update's scale and gain are worked out once per policy update."""
        if self.cold is None:
            return None
        linear = self.policy.linear_observe(observed)
        if linear is None or len(linear) != 1:
            return None
        (name, pair), = linear.items()
        bits = _LINEAR_BITS.get(pair)
        if bits is None:
            bits = _LINEAR_BITS[pair] = (native_pages.float32_bits(pair[0]), native_pages.float32_bits(pair[1]))
        updates: list = []
        for region in regions:
            stat = region.stats.get(name)
            if len(region.stats) != 1 or stat is None or stat.dtype != torch.float32 or not stat.is_contiguous() or \
                    stat.device.type != "cpu":
                return None
            updates.append(native_pages.InPlaceUpdate.statistic(stat, bits))
        heat = self.cold.heat_updates(segments[len(regions):])
        return None if heat is None else updates + heat

    def _read(self, query: torch.Tensor, segments: list, scaling: float, softcap: float | None, need_mass: bool,
              updates: list | None) -> tuple[torch.Tensor, list[torch.Tensor] | None, bool]:
        """The read of ``query`` [B, Hq, q, D] over ``segments``: a tiered store's planned route, else
        ``attention_read``. The third item: whether ``updates`` (:meth:`_updates_in_place`) were made."""
        if self.cold is not None:
            return self._tiered_read(query, segments, scaling, softcap, need_mass, updates)
        return (*attention_read(query, segments, scaling, block_size=self.config.block_size, softcap=softcap,
                                need_mass=need_mass, backend=self.config.read_backend), False)

    def _tiered_read(self, query: torch.Tensor, segments: list, scaling: float, softcap: float | None,
                     need_mass: bool, updates: list | None) -> tuple[torch.Tensor, list[torch.Tensor] | None, bool]:
        """``attention_read`` of a store with a cold tier, on the path planned for reads of this signature.

        The plan (:func:`confkv.attention.read_plan.plan`) depends only on what the signature holds: the library's
        state, the query's device, dtype and shape, softcap and mass, whether the scores fit, and each segment's
        ``read_kind``. So it is made when the signature changes (the first pages, a prefill chunk, the library
        switched off, ...), and a read the plan sends to the native page read calls it directly, without the
        wrappers' checks (:class:`ReadRoute`); any other read goes through ``attention_read``, which plans it
        and counts the fallback with its reason, as before."""
        signature = (loader.generation, query.device, query.dtype, query.shape[:3], softcap, need_mass,
                     native_pages.score_entries(query, segments) <= MAX_SCORES, tuple(s.read_kind for s in segments))
        route = self.read_route
        if route is None or route.signature != signature:
            reader = page_reader(query, segments, softcap, need_mass, self.config.read_backend)
            route = self.read_route = ReadRoute(signature, reader, [getattr(s, "rotation", None) for s in segments])
        if route.reader is not None:
            if updates is not None and route.reader.takes(updates):
                return (*route.reader(query, segments, scaling, need_mass, updates), True)
            return (*route.reader(query, segments, scaling, need_mass), False)
        return (*attention_read(query, segments, scaling, block_size=self.config.block_size, softcap=softcap,
                                need_mass=need_mass, backend=self.config.read_backend), False)

    def _segment(self, region: Region, visible: torch.Tensor) -> KVSegment:
        if region.is_int8:
            return KVSegment(region.keys, region.values, visible, key_token_scale=region.key_scale,
                             key_channel_scale=self.channel_scale, value_token_scale=region.value_scale)
        return KVSegment(region.keys, region.values, visible)

    def _cold_read_pages(self) -> torch.Tensor:
        """[B] cold pages this read takes: the policy's choice at the last step, or its first."""
        if self.cold_read is not None:
            return self.cold_read
        if isinstance(self.cold, LadderTier):
            return torch.full_like(self.seen_real, ALL_PAGES)
        return torch.full_like(self.seen_real, self.policy.first_read_pages())  # type: ignore[attr-defined]


#: (scale, gain) of a policy's linear update -> their float32 bits (a few policies' constants)
_LINEAR_BITS: dict[tuple[float, float], tuple[int, int]] = {}
