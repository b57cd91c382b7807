"""``ConfKVCache``: a transformers ``Cache`` whose layers evict, driven by the model's confidence.

Usage: ``cache = ConfKVCache.for_model(model, memory=0.25)``, then ``model.generate(ids, past_key_values=cache)``;
``cache.trace`` holds each step's budgets, kept tokens, exact KV bytes and confidence (where worked out).

Contract with transformers (METHOD.md, "Integration traps"):

- ``get_seq_length`` / ``get_query_offset`` report the *logical* number of tokens fed
  (positions keep growing); ``get_mask_sizes`` reports the *physical* slots held. The
  attention read itself masks from the positions the store tracks.
- Every forward pass ends with ``end_step(logits)``: confidence from the last position's
  logits (where used), budgets from the policy or the memory target, ageing and eviction in every layer, one trace record.
  confkv's own loops call it themselves (:meth:`steps_by_hand`); after a pass they do not
  drive (transformers' ``generate``), the model's forward hook calls it (:mod:`confkv.hf.enable`).
- ``crop`` (assisted decoding, prompt-lookup) assumes the cache is a prefix: refused.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from confkv import profiling
from confkv.budget import BudgetController
from confkv.confidence import confidence as confidence_of
from confkv.config import ConfidenceConfig, StoreConfig
from confkv.errors import ConfigError, UnsupportedModelError
from confkv.hf.enable import enable, keys_for_attention
from confkv.hf.support import LayerLayout, floor_bytes_of, layer_layout
from confkv.policies import UNLIMITED, Policy
from confkv.tiers.page_file import PageFile
from confkv.policies.tee import TeePolicy
from confkv.policies.tiered import TieredPolicy
from confkv.store import LayerStore, check_store_fits
from confkv.tiers.ladder import LadderTier
from confkv.tiers.byte_model import KVShape
from confkv.tiers.planner import (MemoryTrace, StepPlan, StepRecord, bottom_token_bytes, check_cap, floor_bytes,
                                  floor_tokens, plan_step, reserve_bytes)
from confkv.tiers.storage import MemoryTarget, Storage, store_for

_NO_CROP = ("confkv caches drop tokens, so they cannot be cropped back to a prefix: assisted decoding, "
            "prompt lookup and other speculative methods are not supported. Generate without "
            "`assistant_model`/`prompt_lookup_num_tokens`, or use transformers' DynamicCache for them.")


class ConfKVLayer(CacheLayerMixin):
    """One decoder layer's cache: a thin shell around a :class:`LayerStore`."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, store: LayerStore, owner: "ConfKVCache") -> None:
        super().__init__()
        self.store = store
        self.is_sliding = store.sliding_window is not None
        self._owner = weakref.ref(owner)

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self.store.is_initialized

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:  # set by CacheLayerMixin.__init__; derived here
        pass

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.store.append(key_states, value_states)
        owner = self._owner()
        if owner is not None:
            owner.pass_open = True
        return keys_for_attention(self.store), self.store.recent.values

    def get_seq_length(self) -> int:
        return self.store.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        physical = self.store.physical_length
        return physical + query_length, self.store.seen_tokens - physical

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(_NO_CROP)

    def reset(self) -> None:
        page_file = self.store.cold.page_file if self.store.cold is not None else None
        rope = self.store.cold.rope if self.store.cold is not None else None
        self.store.__init__(self.store.policy, self.store.config, sliding_window=self.store.sliding_window,
                            page_file=page_file, storage=self.store.storage)
        if self.store.cold is not None:
            self.store.cold.rope = rope

    def offload(self) -> None:
        raise NotImplementedError("confkv caches do not support offloading; keep the cache on the model's device")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.store.select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store.is_initialized:
            batch = self.store.seen_real.shape[0]
            self.store.select_batch(torch.arange(batch, device=self.store.seen_real.device).repeat_interleave(repeats))


class ConfKVCache(Cache):
    """A transformers ``Cache`` running a confkv eviction policy in every global-attention layer.

    Args:
        layout: which layers are global (managed by the policy) and which slide.
        policy: a :class:`~confkv.policies.Policy` (see :func:`~confkv.policies.make_policy`).
        store: storage settings (INT8, FP window, prefill chunk, block size).
        trace_limit: keep only the newest ``trace_limit`` trace records (None: every
            step); peak and mean KV bytes still cover the whole run. For endless streams.
        target: a memory target (:class:`~confkv.tiers.storage.MemoryTarget`) the cache holds at
            the end of every step (:mod:`confkv.tiers.planner`); the policy then only ranks, its
            budgets come from the target. None: the policy's own budgets (the paper's rows).
        storage: how tokens are held under ``target`` (default ``Storage(ladder=())``: what the
            hot tier lets go is dropped).
        rope: the model's rotary embedding (:class:`confkv.tiers.prerope.Rope`), for cold-page
            formats that store keys before it (``prerope``); :meth:`for_model` passes it.
        record_confidence: work out the model's confidence at every step, for the trace. Without it, only
            steps that use it do (the paper's gate, a ladder stepping down by ``"confidence"``): NaN elsewhere.
    """

    def __init__(self, layout: LayerLayout, policy: Policy, store: StoreConfig | None = None,
                 trace_limit: int | None = None,
                 rope=None, *, target: MemoryTarget | None = None, storage: Storage | None = None,
                 record_confidence: bool = False) -> None:
        self.rope = rope
        self.record_confidence = record_confidence
        self.policy = policy
        self.store_config = store_for(store, storage)
        self.layout = layout
        if storage is not None and target is None:
            raise ConfigError("storage: a storage holds a memory target; give memory= (a fraction of the full "
                              "cache's bytes) or max_kv_bytes= with it")
        self.target = target
        self.storage = storage if storage is not None or target is None else Storage(ladder=())
        self._validate()
        tiered = isinstance(policy, TieredPolicy)
        offload = (tiered and policy.cold.offload) or (self.storage is not None and self.storage.offload)
        offload_dir = policy.cold.offload_dir if tiered else (self.storage.offload_dir if self.storage else None)
        #: one file per cache for offloaded cold pages (unlinked at creation; closed with the cache)
        self.page_file = PageFile(offload_dir) if offload else None
        stores = [LayerStore(policy, self.store_config, sliding_window=w, page_file=self.page_file,
                             storage=self.storage) for w in layout.sliding_windows]
        for layer_store in stores:
            if layer_store.cold is not None:
                layer_store.cold.rope = rope
        super().__init__(layers=[ConfKVLayer(s, self) for s in stores])
        self.managed = layout.managed
        self.controller = BudgetController(policy, len(self.managed))
        self.trace = MemoryTrace(max_steps=trace_limit)
        self.evict = True  # set False to defer eviction (e.g. query-aware prefill)
        gate = getattr(policy, "gate", None)
        self.confidence_config: ConfidenceConfig = gate.confidence if gate is not None else ConfidenceConfig()
        self._ladder_by_confidence = self.storage is not None and self.storage.step_down_by == "confidence"
        #: True between the first cache write of a forward pass and its ``end_step``
        self.pass_open = False
        #: True while the caller closes every step itself (:meth:`steps_by_hand`): the model's hook then stays out
        self.closes_own_steps = False
        self.floor_tokens = floor_tokens(policy, self.store_config) if target is not None else 0
        self._policy_at: dict[int, Policy] = {}
        self.last_plan: StepPlan | None = None
        self._cap_checked = 0  # the batch size the cap was checked against (its floor grows with the batch)
        self._byte_terms_of: tuple | None = None  # (heads, head_dim, element size) and their byte terms

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def for_model(cls, model: torch.nn.Module, policy: str | Policy | None = None, *, memory: float | None = None,
                  max_kv_bytes: int | None = None, storage: Storage | None = None, store: StoreConfig | None = None,
                  trace_limit: int | None = None, record_confidence: bool = False,
                  **policy_params: Any) -> "ConfKVCache":
        """Build a cache for ``model`` and switch the model to confkv attention (see :func:`confkv.hf.enable`).

        - ``for_model(model)``: the best measured preset (:data:`confkv.presets.DEFAULT_PRESET`) at
          ``memory=0.25``; ``for_model(model, memory=0.125)``: the same preset at another target.
        - ``memory``: a fraction in (0, 1] of the full cache's bytes at the current length, held at
          the end of every step, every tier counted; ``max_kv_bytes``: an absolute cap instead.
        - ``policy``: a preset name (``"tiered"``, ``"kivi-4"``, ...: its ranking and storage), a
          registry name or a :class:`Policy`. With a target, a plain policy only ranks (its budget
          comes from the target) and evicted tokens are dropped unless ``storage`` gives a ladder.
          Without a target (``policy="confkv"``, ...) the policy's own budgets run: the paper's rows.
        - ``policy_params``: the policy's parameters; with a preset, :class:`Storage` field names
          (``ladder``, ``hot_share``, ...) override the preset's storage.
        - ``record_confidence``: the model's confidence at every step in the trace (see the class).
        """
        from confkv.presets import resolve  # noqa: PLC0415

        layout = layer_layout(model.config)
        spec = resolve(policy, memory=memory, max_kv_bytes=max_kv_bytes, storage=storage, **policy_params)
        built, target, storage = spec.policy, spec.target, spec.storage
        from confkv.tiers.prerope import Rope  # noqa: PLC0415

        if max_kv_bytes is not None:
            check_cap(max_kv_bytes, floor_bytes_of(model, layout, built, store_for(store, storage)))
        enable(model)
        return cls(layout, built, store, trace_limit=trace_limit, rope=Rope.from_model(model), target=target,
                   storage=storage, record_confidence=record_confidence)

    def fork(self, member: int) -> "ConfKVCache":
        """A copy of this cache run from now on by member ``member`` of its :class:`TeePolicy`.

        For one shared prefill, then several policies (query-aware comparisons): prefill with
        ``for_model(model, TeePolicy.of(members))`` and ``cache.evict = False``, then ``cache.fork(i).end_step(logits)``
        brings member ``i``'s copy (cloned tensors, its statistics, a fresh gate, the trace so far) to its budget.
        """
        if not isinstance(self.policy, TeePolicy):
            raise ValueError("confkv: fork() needs a cache built with a TeePolicy (one prefill, several policies)")
        if not 0 <= member < len(self.policy.members):
            raise ValueError(f"confkv: member {member} out of range; the tee has {len(self.policy.members)}")
        policy = self.policy.members[member]
        twin = ConfKVCache(self.layout, policy, self.store_config, trace_limit=self.trace.max_steps, rope=self.rope,
                           target=self.target, storage=self.storage, record_confidence=self.record_confidence)
        tee = self.policy
        for twin_layer, layer in zip(twin.layers, self.layers):
            twin_layer.store = layer.store.fork(policy, lambda stats: tee.member_stats(member, stats))
        twin.trace = copy.copy(self.trace)
        twin.trace.steps = list(self.trace.steps)
        return twin

    def clone(self) -> "ConfKVCache":
        """An independent deep copy: cloned tensors, policy statistics, gate state and trace.

        For a look-ahead that must not touch this cache (e.g. a teacher-forced agent
        step: the model's own action is generated on a clone, then the expert's action
        is fed to this cache). Forward passes on the clone close their steps on the
        clone (its layers point back to it, not to this cache).
        """
        twin = copy.deepcopy(self)
        for layer in twin.layers:
            layer._owner = weakref.ref(twin)
        return twin

    def _validate(self) -> None:
        check_store_fits(self.policy, self.store_config)

    # -- the step --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def steps_by_hand(self) -> Iterator["ConfKVCache"]:
        """``with cache.steps_by_hand(): out = model(..., cache=cache); cache.end_step(out.logits[:, -1])``:
        inside, the model's forward hook leaves this cache's steps to the caller."""
        before = self.closes_own_steps
        self.closes_own_steps = True
        try:
            yield self
        finally:
            self.closes_own_steps = before

    def end_step(self, logits: torch.Tensor) -> None:
        """Close one forward pass: confidence, budgets, ageing/eviction, trace.

        Args:
            logits: [B, V] each sequence's last-position logits as the model returns them (after
                Gemma's final soft-cap, where the model has one).
        """
        self.pass_open = False
        stores = [layer.store for layer in self.layers]
        if any(s.pending for s in stores):
            raise UnsupportedModelError(
                "confkv: keys were cached but never read by confkv attention; the model is not running with "
                "attn_implementation='confkv'. Build the cache with ConfKVCache.for_model(model, ...) "
                "or call confkv.hf.enable(model) first.")
        tiered = isinstance(self.policy, TieredPolicy)
        on_target = self.target is not None and self.evict
        if self.record_confidence or not on_target or tiered or self._ladder_by_confidence:
            with profiling.section("confidence"):
                conf = confidence_of(logits.detach(), self.confidence_config)
        else:  # nothing in this step reads it: not worked out (NaN in the trace); NaN logits still warned of
            conf = _unscored(logits)
        if not on_target or tiered:  # under a target the plan sets the budgets: the gate would run for nothing
            with profiling.section("budget gate"):
                budgets = self.controller.step(conf)
                budget_of = {layer_idx: budgets[:, j] for j, layer_idx in enumerate(self.managed)}
        cold_read = self.policy.cold_read_pages(self.controller.gated) if tiered else None
        if on_target:
            budgets = self._end_step_on_target(stores, conf, cold_read)
        else:
            self.last_plan = None
            for layer_idx, store in enumerate(stores):
                store.end_step(budget_of.get(layer_idx) if self.evict else None, cold_read)
        with profiling.section("trace record"):
            self.trace.record(StepRecord.of_stores(stores, conf, budgets,
                                                   self.last_plan.target_bytes if self.last_plan is not None else None))

    def _end_step_on_target(self, stores: list[LayerStore], conf: torch.Tensor,
                            cold_read: torch.Tensor | None) -> torch.Tensor:
        """End the step under the memory target: sliding layers, the plan, then every managed layer's
        eviction (the planned hot budget) and ladder fit. Returns the budgets [B, managed] recorded."""
        managed = set(self.managed)
        for layer_idx, store in enumerate(stores):
            if layer_idx not in managed:
                store.end_step(None, cold_read)
        first = stores[self.managed[0]] if self.managed else None
        if first is None or not first.is_initialized:
            return torch.full((conf.shape[0], len(self.managed)), UNLIMITED, dtype=torch.int64)
        keys = first.recent.keys
        shape, token, row_reserve, bottom = self._byte_terms(keys)
        if self.target.max_kv_bytes is not None and self._cap_checked != keys.shape[0]:
            check_cap(self.target.max_kv_bytes, floor_bytes(shape, self.layout, self.floor_tokens, self.store_config,
                                                            batch=keys.shape[0]))
            self._cap_checked = keys.shape[0]
        with profiling.section("memory plan"):
            plan = plan_step(self.target, self.storage, batch=keys.shape[0], seen=first.seen_tokens,
                             token_bytes=token, managed=len(self.managed),
                             sliding_bytes=sum(s.kv_bytes() for i, s in enumerate(stores) if i not in managed),
                             floor_tokens=self.floor_tokens, reserve_bytes=keys.shape[0] * row_reserve,
                             bottom_token_bytes=bottom, reserve_held=not first.int8_later)
        self.last_plan = plan
        hot = plan.hot_budget
        row = None if hot is None else torch.full(first.seen_real.shape, hot, dtype=torch.int64)
        policy = self.policy if hot is None else self._ranking_policy(hot)
        for layer_idx in self.managed:
            store = stores[layer_idx]
            store.policy = policy
            if self._ladder_by_confidence and isinstance(store.cold, LadderTier):
                store.cold.set_confidence(conf)
            store.end_step(row, cold_read)
            store.fit(plan.layer_bytes)
        return torch.full((conf.shape[0], len(self.managed)), UNLIMITED if hot is None else hot, dtype=torch.int64)

    def _byte_terms(self, keys: torch.Tensor) -> tuple[KVShape, int, int, float]:
        """(KV shape, bytes of a full-precision token, reserve per sequence, a bottom-rung token's bytes) for keys
        [B, Hkv, L, D], fixed by the model, store config and storage: worked out once, kept while they hold."""
        key = (keys.shape[1], keys.shape[3], keys.element_size())
        if self._byte_terms_of is None or self._byte_terms_of[0] != key:
            shape = KVShape(*key, self.layout.sliding_windows)
            bottom = bottom_token_bytes(self.storage, shape, keys.dtype) if self.storage.hot_split == "keep_all" else 0.0
            self._byte_terms_of = (key, (shape, shape.token_bytes, reserve_bytes(shape, self.store_config), bottom))
        return self._byte_terms_of[1]

    def _ranking_policy(self, budget: int) -> Policy:
        """The policy with its ``budget`` set to the planned one (policies whose ranking depends on it,
        e.g. H2O's recent share), cached per budget; a policy without a ``budget`` field as it is."""
        if budget not in self._policy_at:
            has_budget = any(f.name == "budget" for f in dataclasses.fields(self.policy))
            self._policy_at[budget] = dataclasses.replace(self.policy, budget=budget) if has_budget else self.policy
        return self._policy_at[budget]

    # -- reporting -------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Exact KV bytes held now, all layers and tiers (offloaded cold pages included)."""
        return sum(layer.store.kv_bytes() for layer in self.layers)

    def offloaded_bytes(self) -> int:
        """Of :meth:`kv_bytes`, the bytes in the page file (``cold.offload``); the rest is resident."""
        return sum(layer.store.offloaded_bytes() for layer in self.layers)

    def close(self) -> None:
        """Release the page file of an offloaded cold tier (also done when the process ends)."""
        if self.page_file is not None:
            self.page_file.close()

    def kept_counts(self) -> torch.Tensor:
        """[num_layers, B] tokens kept per layer and sequence."""
        return torch.stack([layer.store.kept_counts() for layer in self.layers])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(_NO_CROP)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.controller.select_batch(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.controller.select_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.controller.gated is not None:
            self.controller.gated = self.controller.gated.repeat_interleave(repeats)


def _unscored(logits: torch.Tensor) -> torch.Tensor:
    """[B] NaN, the confidence of a step that nothing reads, for logits [B, V]; NaN logits still warned of."""
    if bool(torch.isnan(logits).any()):
        warnings.warn(f"confkv: NaN logits in {int(torch.isnan(logits).any(dim=-1).sum())} sequence(s); the model's "
                      "output is not a number (check the inputs, the dtype and the weights)", RuntimeWarning, stacklevel=3)
    return torch.full((logits.shape[0],), math.nan)
