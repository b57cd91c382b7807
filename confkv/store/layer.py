"""Per-layer KV store: an older region (INT8 or full precision) and a recent FP window.

Layout of one layer (every tensor dense, no index tables)::

    old    : [B, Hkv, L_old, D]   INT8 + per-token scales (kv_int8) or model dtype
    recent : [B, Hkv, L_rec, D]   model dtype; the newest tokens, never evicted

New tokens are appended to ``recent``. At the end of a step (``end_step``):

1. *ageing*: once ``recent`` holds ``recent_len + move_block`` slots (or at once
   when the layer is over budget), its oldest slots move to ``old`` (quantised on
   the way when ``kv_int8``), so ``old`` is rewritten once per ``move_block`` steps
   and tokens are quantised exactly once;
2. *eviction*: if a sequence holds more than its budget, ``old`` is compacted by one
   gather to the policy's best slots (``recent`` and the policy's protected and sink
   tokens are kept). With a tiered policy (:class:`~confkv.policies.tiered.TieredPolicy`)
   the evicted slots are demoted to the layer's cold tier (:mod:`confkv.tiers.cold`) instead of
   deleted, and every attention read adds the cold pages the policy's read budget selects.

The store counts tokens seen (logical, for positions) apart from slots held
(physical, for the attention read), and reports its exact bytes.
"""

from __future__ import annotations

from typing import Callable

import torch

from confkv import profiling
from confkv.tiers.cold import ColdTier
from confkv.config import StoreConfig
from confkv.errors import ConfigError
from confkv.native.decode import DecodePlan
from confkv.tiers.page_file import PageFile
from confkv.policies.base import UNLIMITED, Policy
from confkv.policies.tiered import TieredPolicy
from confkv.store import hot_tier, promotion
from confkv.store.read import AttentionRead
from confkv.store.hot_tier import Region, concat, select_batch
from confkv.store.window_buffer import WindowBuffer
from confkv.tiers.ladder import LadderTier
from confkv.tiers.storage import Storage


def check_store_fits(policy: Policy, config: StoreConfig) -> None:
    """Raise :class:`ConfigError` when ``config`` cannot honour ``policy``'s smallest budget.

    With ``kv_int8`` the FP window (never evicted) plus the sinks must fit the budget.
    Callers run it before loading a model, so a bad combination fails in milliseconds.
    """
    if config.kv_int8 and policy.min_budget() < UNLIMITED and config.fp_window + policy.sinks >= policy.min_budget():
        raise ConfigError(
            f"fp_window: the FP window of {config.fp_window} tokens (never evicted) plus {policy.sinks} sinks "
            f"does not fit the smallest budget {policy.min_budget()}; lower fp_window or raise the budget")


class LayerStore(AttentionRead):
    """The KV store of one attention layer: its state, what it keeps (here) and its read (:class:`AttentionRead`).

    Args:
        policy: the eviction policy (shared by the managed layers of a cache).
        config: storage settings.
        sliding_window: for a sliding-window layer (Gemma-3 local layers), its window
            ``W``: queries see keys with ``query_pos - key_pos < W``, the store keeps the
            last ``W - 1`` tokens, uses full precision and ignores the policy.
        page_file: the cache's file for offloaded cold pages (tiered policies with
            ``cold.offload``; None: the store opens its own when it needs one).
        storage: the storage of a cache under a memory target (:class:`~confkv.tiers.storage.Storage`):
            with a non-empty ladder, what the hot tier lets go goes to a :class:`LadderTier`, and
            :meth:`fit` holds a byte budget. Not with a tiered policy (it brings its own cold tier).
    """

    def __init__(self, policy: Policy, config: StoreConfig, *, sliding_window: int | None = None,
                 page_file: PageFile | None = None, storage: Storage | None = None) -> None:
        self.policy = policy
        self.config = config
        self.storage = storage
        self.sliding_window = sliding_window
        # INT8 older region: from the start, or (``int8_from="over_budget"``) from the first step that evicts
        self.int8 = config.kv_int8 and sliding_window is None and config.int8_from == "start"
        if sliding_window is not None:
            self.recent_len = 0
        elif config.kv_int8:
            self.recent_len = config.fp_window  # never evicted: effective protection is max(protect, W)
        else:
            self.recent_len = policy.protect
        self.stat_names = () if sliding_window is not None else policy.stat_names
        self.old: Region | None = None
        self.recent: Region | None = None
        self.channel_scale: torch.Tensor | None = None  # [B, Hkv, D] fp32, frozen once set (INT8 keys)
        self.seen_tokens = 0  # columns fed, padding included (the logical length HF sees)
        self.seen_real: torch.Tensor | None = None  # [B] int64, real (non-padding) tokens per sequence
        self.pending = 0  # tokens appended by `append` whose attention has not been read yet
        self.last_queries = 1  # queries of the last attention read (a prefill chunk's tokens)
        self.cold: ColdTier | None = None
        self.cold_read: torch.Tensor | None = None  # [B] cold pages the next read takes (None: the first)
        self.window: WindowBuffer | None = None  # the recent region's slots with spare capacity (decode_step)
        self.decode_plan: DecodePlan | None = None  # the pointers of the native decode step (_decode_in_place)
        self.read_route = None  # with a cold tier: the read path planned for the last signature (read.ReadRoute)
        self.page_handling = None  # with a cold tier: (key, paged, turns_pages), see AttentionRead._page_handling
        if isinstance(policy, TieredPolicy) and sliding_window is None:
            if policy.cold.promote is not None and not policy.needs_attention:
                raise ConfigError(f"promote: policy {policy.name!r} reads no attention mass, so no page can earn "
                                  "promotion; use confkv-r or leave promote unset")
            if policy.cold.offload and page_file is None:
                page_file = PageFile(policy.cold.offload_dir)
            self.cold = ColdTier(policy.cold, page_file if policy.cold.offload else None)
        if storage is not None and isinstance(policy, TieredPolicy):
            raise ConfigError(f"storage: policy {policy.name!r} brings its own cold tier (policy.cold); give a ranking "
                              "policy (e.g. 'tova', 'h2o', 'confkv-fixed') with storage=, or the preset 'tiered'")
        if storage is not None and storage.ladder and sliding_window is None:
            if storage.offload and page_file is None:
                page_file = PageFile(storage.offload_dir)
            self.cold = LadderTier(storage, page_file)

    @property
    def int8_later(self) -> bool:
        """True while an INT8 store that starts at its first eviction (``int8_from="over_budget"``) is not INT8 yet."""
        return self.config.kv_int8 and self.sliding_window is None and not self.int8

    # -- shape -----------------------------------------------------------------------------------
    @property
    def is_initialized(self) -> bool:
        return self.recent is not None

    @property
    def physical_length(self) -> int:
        """Slots held (old + recent), the length the attention read walks."""
        if not self.is_initialized:
            return 0
        return self.old.length + self.recent.length

    def kept_counts(self) -> torch.Tensor:
        """[B] int64 tokens each sequence currently keeps (padding excluded)."""
        if not self.is_initialized:
            return torch.zeros(0, dtype=torch.int64)
        if self.old.all_valid and self.recent.all_valid:
            return torch.full(self.seen_real.shape, self.physical_length, dtype=torch.int64,
                              device=self.seen_real.device)
        return self.old.valid.sum(-1) + self.recent.valid.sum(-1)

    def kept_list(self) -> list[int]:
        """:meth:`kept_counts` as Python ints (no tensor op when every slot is valid)."""
        if self.is_initialized and self.old.all_valid and self.recent.all_valid:
            return [self.physical_length] * self.seen_real.shape[0]
        return self.kept_counts().tolist()

    def kv_bytes(self) -> int:
        """Exact bytes of the stored keys and values of every tier: INT8 scales, cold scales and digests included."""
        if not self.is_initialized:
            return 0
        return self.hot_bytes() + (self.cold.kv_bytes() if self.cold is not None else 0)

    def offloaded_bytes(self) -> int:
        """Of :meth:`kv_bytes`, the bytes kept in the page file rather than RAM."""
        return self.cold.offloaded_bytes() if self.cold is not None else 0

    def cold_counts(self) -> torch.Tensor:
        """[B] int64 tokens each sequence holds in the cold tier (zeros without one)."""
        held = self.cold.token_count() if self.cold is not None else None
        if held is None:
            return torch.zeros_like(self.seen_real) if self.seen_real is not None else torch.zeros(0, dtype=torch.int64)
        return held

    def bookkeeping_bytes(self) -> int:
        """Bytes of positions, validity flags and policy statistics."""
        if not self.is_initialized:
            return 0
        cold = self.cold.bookkeeping_bytes() if self.cold is not None else 0
        return self.old.bookkeeping_nbytes() + self.recent.bookkeeping_nbytes() + cold

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` [B'] (beam search reorder, sequence removal)."""
        if not self.is_initialized:
            return
        self.old, self.recent = select_batch(self.old, index), select_batch(self.recent, index)
        self.window = None  # the recent region is a fresh copy now
        self.seen_real = self.seen_real.index_select(0, index.to(self.seen_real.device))
        if self.cold is not None:
            self.cold.select_batch(index)
        if self.cold_read is not None:
            self.cold_read = self.cold_read.index_select(0, index.to(self.cold_read.device))
        if self.channel_scale is not None:
            self.channel_scale = self.channel_scale.index_select(0, index.to(self.channel_scale.device))

    def fork(self, policy: Policy,
             stats_of: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> LayerStore:
        """An independent copy of this store, run by ``policy`` from now on.

        Every tensor is cloned (policies update statistics in place), positions, scales and
        counters are kept; the FP window size follows ``policy`` at the next ``end_step``.

        Args:
            policy: the policy of the copy.
            stats_of: maps a region's statistics to ``policy``'s names (e.g.
                :meth:`~confkv.policies.tee.TeePolicy.member_stats`); default: the same names.
        Raises:
            ValueError: a statistic ``policy`` needs is missing, or keys are pending.
        """
        twin = LayerStore(policy, self.config, sliding_window=self.sliding_window,
                          page_file=self.cold.page_file if self.cold is not None else None, storage=self.storage)
        if self.cold is not None and twin.cold is not None:
            twin.cold = self.cold.clone()
        twin.int8 = self.int8
        if not self.is_initialized:
            return twin
        if self.pending:
            raise ValueError("confkv: cannot fork a store in the middle of a forward pass")

        def copy(region: Region) -> Region:
            # a sliding-window layer keeps no statistics for any policy: nothing to map
            stats = stats_of(region.stats) if stats_of is not None and twin.stat_names else region.stats
            missing = [name for name in twin.stat_names if name not in stats]
            if missing:
                raise ValueError(f"confkv: cannot fork for policy {policy.name!r}: statistics {missing} were "
                                 "never collected (prefill with a TeePolicy that includes it)")
            return region.clone(stats={name: stats[name] for name in twin.stat_names})

        twin.old, twin.recent = copy(self.old), copy(self.recent)
        twin.channel_scale = None if self.channel_scale is None else self.channel_scale.clone()
        twin.seen_tokens = self.seen_tokens
        twin.seen_real = self.seen_real.clone()
        return twin

    # -- the step --------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add this pass's new keys/values [B, Hkv, q, D] at the end of the FP window.

        Their positions and validity are filled in by :meth:`attend`, which knows the padding.
        """
        with profiling.section("append (FP window)"):
            batch, kv_heads, new, head_dim = keys.shape
            if not self.is_initialized:
                self.old = Region.empty(batch, kv_heads, head_dim, keys.dtype, keys.device, self.stat_names, self.int8)
                self.recent = Region.empty(batch, kv_heads, head_dim, keys.dtype, keys.device, self.stat_names)
                self.seen_real = torch.zeros(batch, dtype=torch.int64, device=keys.device)
            if self.pending:
                raise RuntimeError("confkv: a layer received new keys twice without an attention read in between; "
                                   "the model must run with attn_implementation='confkv' (use confkv.hf.enable(model))")
            fresh = Region(
                keys=keys, values=values,
                positions=torch.zeros((batch, kv_heads, new), dtype=torch.int64, device=keys.device),
                valid=torch.ones((batch, new), dtype=torch.bool, device=keys.device),
                stats={name: keys.new_zeros((batch, kv_heads, new), dtype=torch.float32) for name in self.stat_names},
                all_valid=True,  # until `_place_new_tokens` sees padding
            )
            self.recent = concat(self.recent, fresh)
            self.window = None  # the recent region is a fresh copy now
            self.seen_tokens += new
            self.pending = new

    def end_step(self, budget: torch.Tensor | None, cold_read: torch.Tensor | None = None) -> None:
        """Age the FP window and evict down to ``budget`` [B] (None or UNLIMITED: no eviction). ``cold_read`` [B]:
        cold pages the next read takes (tiered policies; None keeps the last)."""
        if cold_read is not None and self.cold is not None:
            self.cold_read = cold_read.to(torch.int64)
        if not self.is_initialized or self.pending:
            return
        with profiling.section("eviction bookkeeping"):
            if self.sliding_window is not None:
                budget = torch.full_like(self.seen_real, self.sliding_window - 1)
            if budget is None:
                over_budget = False
            elif self.old.all_valid and self.recent.all_valid:
                over_budget = self.physical_length > min(budget.tolist())
            else:
                over_budget = bool((self.kept_counts() > budget.to(self.seen_real.device)).any())
        if over_budget and self.int8_later:
            self._start_int8()
        if over_budget and hot_tier.age_and_evict_at_once(self, budget):  # the steady state in one C call
            return
        self._age(force=over_budget)
        self._evict(budget)

    def hot_bytes(self) -> int:
        """Of :meth:`kv_bytes`, the hot tier's (every region in the model's precision or INT8, spare slots included;
        the INT8 keys' channel scale). Worked out without the cold tier's bytes: the planner asks it every step."""
        if not self.is_initialized:
            return 0
        extra = self.channel_scale.nbytes if self.channel_scale is not None else 0
        window = self.recent.nbytes()
        if self.window is not None:  # its spare slots are held too
            window = self.window.nbytes() + (0 if self.window.backs(self.recent) else window)
        return self.old.nbytes() + window + extra

    def fit(self, budget_bytes: int) -> None:
        """Bring the cold ladder under ``budget_bytes - hot_bytes()`` (:meth:`LadderTier.fit`); no-op without one."""
        if isinstance(self.cold, LadderTier) and self.is_initialized:
            self.cold.fit(budget_bytes - self.hot_bytes(), self.recent.keys.dtype)

    def _age(self, force: bool) -> None:
        """Move the oldest FP-window slots to the older region.

        Normally in groups of ``move_block`` (the older region is rewritten once per group);
        when the layer is over budget, at once, so that eviction can reach them.
        """
        surplus = self.recent.length - self.recent_len
        if surplus <= 0 or (surplus < self.config.move_block and not force):
            return
        moving = self.recent.slice(0, surplus)
        self.recent = self.recent.slice(surplus, self.recent.length, copy=True)  # frees the old window
        self.window = None  # its buffer too: the next decode step makes one around the new window
        if self.int8:
            with profiling.section("quantization"):
                moving = self._quantize(moving)
        with profiling.section("ageing (old-region concat)"):
            self.old = concat(self.old, moving)

    def _start_int8(self) -> None:
        """``int8_from="over_budget"``: the first step over budget quantizes the older region once; every token
        that ages from now on is quantized on the way (:meth:`_age`), as with ``int8_from="start"``."""
        self.int8 = True
        self.window, self.decode_plan = None, None  # the fast full-precision decode no longer applies
        old = self.old
        if old.length:
            with profiling.section("quantization"):
                self.old = self._quantize(old)
        else:
            self.old = Region.empty(old.valid.shape[0], old.keys.shape[1], old.keys.shape[3], old.keys.dtype,
                                    old.keys.device, self.stat_names, True)

    def _quantize(self, region: Region) -> Region:
        from confkv import quant  # noqa: PLC0415 - the INT8 path only

        if self.channel_scale is None:
            calibration = region.keys * region.valid[:, None, :, None].to(region.keys.dtype)
            self.channel_scale = quant.key_channel_scale(calibration)
        keys, key_scale = quant.quantize_keys(region.keys, self.channel_scale)
        values, value_scale = quant.quantize_values(region.values)
        return Region(keys=keys, values=values, positions=region.positions, valid=region.valid,
                      stats=region.stats, key_scale=key_scale, value_scale=value_scale, all_valid=region.all_valid)

    def _evict(self, budget: torch.Tensor | None) -> None:
        with profiling.section("eviction bookkeeping"):
            old = self.old
            if old.all_valid and self.recent.all_valid:
                # every slot valid: counts are lengths, no holes; nothing to do unless over budget
                if budget is None or old.length + self.recent.length <= min(budget.tolist()):
                    return
            old_count = old.valid.sum(-1)
            if budget is None:
                keep = old_count
            else:
                budget = budget.to(old_count.device).clamp(max=UNLIMITED)
                keep = (budget - self.recent.valid.sum(-1)).clamp_min(0)
            current = self.seen_real - 1
            protect = self.policy.protect if self.sliding_window is None else 0
            sinks = self.policy.sinks if self.sliding_window is None else 0
            over_budget = bool((old_count > keep).any())
            has_holes = old.length > int(old_count.max()) if old.length else False
        if not (over_budget or has_holes):
            return
        with profiling.section("ranking and top-k"):
            slack = self.config.evict_slack if self.sliding_window is None else 0
            if self.sliding_window is not None:
                scores = old.positions.float()
            else:
                scores = self.policy.scores(old.stats, old.positions, current)
            if slack and over_budget and not isinstance(slack, float):
                # evict down to budget - slack: the next `slack` steps need no compaction
                keep = torch.where(old_count > keep, (keep - slack).clamp_min(0), keep)
            # every slot valid, as many kept in every sequence: the split in one C call (None: the torch path decides)
            split = hot_tier.split_by_rank(old, scores, current, protect, sinks, keep) if (
                over_budget and old.all_valid and not isinstance(slack, float)) else None
            if split is None:
                protected = hot_tier.protected_mask(old.positions, old.valid, current, protect, sinks)
                floor = protected.sum(-1).amax(-1)  # [B] protected tokens and sinks: kept whatever the budget
                if slack and over_budget and isinstance(slack, float):
                    # that share of the tokens each sequence keeps by rank, above its floor (none at the floor)
                    slack = ((keep - floor).clamp_min(0).double() * slack).long()
                    keep = torch.where(old_count > keep, (keep - slack).clamp_min(0), keep)
                keep = torch.maximum(keep, floor)
                index, valid = hot_tier.select_kept(scores, old.valid, protected, keep)
        with profiling.section("compaction gather"):  # the cold tier's demotion is timed inside it too
            ranked_by_attention = self.storage is not None and self.storage.unread_by != "age"  # attention while hot
            policy = self.policy if ranked_by_attention else None
            if split is not None:
                self.old, dropped = split
                if self.cold is not None:
                    hot_tier.demote_slots(self.cold, dropped, dropped.valid, self.channel_scale,
                                          self.recent.keys.dtype, policy, current, self.last_queries)
                return
            if self.cold is not None:
                hot_tier.demote_dropped(self.cold, old, index, valid, self.channel_scale, self.recent.keys.dtype,
                                          policy, current, self.last_queries)
            self.old = old.gather(index, valid, all_valid=bool(valid.all()))

    def _promote(self, page_mass: torch.Tensor) -> None:
        """Move each head's most-attended read page back into the older hot region (in position order).

        The hot tier is then over budget by a page; :meth:`end_step` demotes its lowest-ranked tokens.
        """
        taken = self.cold.take_best_read_page(page_mass, self.cold.config.promote)
        if taken is None:
            return
        back = promotion.promoted_region(taken, self.policy, self.stat_names, self.recent.keys.dtype)
        if self.int8:
            back = self._quantize(back)
        self.old = promotion.merge_in_position_order(self.old, back)
