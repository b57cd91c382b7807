"""How a cache holds tokens (:class:`Storage`) and how much it may hold (:class:`MemoryTarget`).

A policy ranks tokens; storage decides how they are held (ARCHITECTURE.md, "Three things a
cache is made of"). The hot tier keeps the best-ranked tokens in the model's precision; the
cold tier keeps every token the hot tier lets go, in pages on a *ladder* of bit widths: a page
enters at the top rung and steps down one rung at a time when the cache is over its target,
the least valuable pages first; a page is dropped only from the bottom rung. Mixed precision
by importance as in MiKV (Yang et al. 2024, "No Token Left Behind: Reliable KV Cache
Compression via Importance-Aware Mixed Precision Quantization"), inside one byte target.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from confkv.config import StoreConfig, _require, check_pages

#: bit widths a rung may have: 16 = the model's dtype (unquantized), the rest KIVI-style codes
RUNG_BITS = (16, 8, 4, 3, 2)
#: what ranks cold pages for stepping down (see :meth:`confkv.tiers.cold.ColdTier.page_value`)
STEP_DOWN_SIGNALS = ("heat", "confidence", "age")
#: which rung steps down next (see :mod:`confkv.tiers.ladder`)
STEP_ORDERS = ("error", "coldest")
#: what orders pages never read since sealing (their heat unknown) among themselves (see :mod:`confkv.tiers.ladder`)
UNREAD_ORDERS = ("age", "attention", "attention-drops")
#: how the planner splits a layer's bytes between the hot tier and the ladder (see :mod:`confkv.tiers.planner`)
HOT_SPLITS = ("share", "keep_all")


@dataclass(frozen=True)
class Storage:
    """Storage settings of a cache under a memory target.

    Attributes:
        ladder: the cold tier's bit widths, top rung first, strictly decreasing, each one of
            16, 8, 4, 3, 2. ``()``: no cold tier, tokens the hot tier lets go are dropped
            (what an eviction policy does).
        hot_share: the share of each layer's bytes the hot (full-precision) tier may take
            when the cache is over its target; the cold tier gets the rest.
        hot_tokens: a fixed hot tier of this many tokens per layer instead of ``hot_share``
            (KIVI's full-precision residual), or None.
        hot_split: with a ladder and no ``hot_tokens``: ``"share"`` the hot tier takes ``hot_share`` of the
            bytes whatever the ladder must then drop; ``"keep_all"`` it takes at most that, and gives bytes back
            (down to the floor) while the ladder could not otherwise keep every token at its bottom rung: the
            hot tier's full precision steps down before any token is dropped (:func:`confkv.tiers.planner.plan_step`;
            measured: 0.4 points better at 25%, the same at 12.5%, results/memory/README.md, "A smaller hot tier").
        page_size: tokens per cold page (one KV head of one sequence).
        group_size: quantization group (tokens for keys, channels for values); divides ``page_size``.
        step_down_by: the page value that orders stepping down and dropping: ``"heat"``
            (attention received per read), ``"confidence"`` (``1 -`` the model's confidence at
            the step the page was demoted) or ``"age"`` (oldest first).
        step_order: which rung gives the next page: ``"error"`` (default) the rung whose least
            valuable page adds the least quantization error per byte saved (the page's value times the
            growth of a uniform quantizer's squared step, ``4**-bits``, over the bytes freed), so that
            pages spread over the upper rungs before any reaches the bottom; ``"coldest"`` the rung
            holding the least valuable page (cold pages sink to the bottom first).
        unread_by: with ``step_down_by="heat"``, the order among pages not read since they were sealed
            (their heat unknown, so equal): ``"age"`` oldest first; ``"attention"`` the least attention
            their tokens received per query while they were hot first (the ranking policy's estimate,
            :meth:`confkv.policies.base.Policy.attention_per_read`, a chunk's own tokens scaled to the
            queries that could see them; oldest first for a policy without one). It decides which tokens of
            a prefill chunk a small target keeps (results/memory/README.md, "Unread pages"). ``"attention-drops"``:
            unread pages step down oldest first (as ``"age"``) and are dropped least attended first (as
            ``"attention"``): the rungs' bits follow the default's order and only which unread pages are dropped
            changes (in a chunked prefill, those of the first chunk above all: results/qwen/README.md).
        format: the page format of every rung (:mod:`confkv.tiers.formats`: ``"kivi"`` or techniques
            joined by ``+``, e.g. ``"hadamard+outliers+codebook"``); ``outlier_fraction``: the share of a
            page's values kept apart in 16 bits by the ``outliers`` technique. Checked by
            :class:`~confkv.config.ColdConfig` when the rungs are built. ``rotation_seed``: with ``hadamard``,
            the seed of the rotation's random signs, one rotation for every rung (``ColdConfig.rotation_seed``).
        seal_early: when the cache is over its target with no sealed page left, seal the open page as
            a partial page (then step it down) if its tokens cost more than a bottom-rung page; False:
            drop its oldest tokens instead (early in a run under ``memory=``, the open page is most of
            the target; results/memory/README.md).
        seal_before_drop: when the cache is over its target and no page can step down, seal the open page (then
            step it down) before any bottom-rung page is dropped, whenever it is at least half full and its tokens
            cost more than a bottom page; False: only once no sealed page is left (``seal_early``). Early in a run
            the full-precision open page can hold most of the target while older pages are dropped whole. Measured
            (pydoc-topics, 2K): more tokens held, perplexity 1.7 points worse at 25% and 1.4 better at 12.5%
            (results/memory/README.md, "The open page sealed before a page is dropped").
        hot_int8_window: None (default): the hot tier in the model's precision; ``W``: the hot tier's tokens older
            than its ``W`` newest are kept in INT8 (per-channel key scale, per-token value scale: METHOD.md step 4),
            from the first step the cache is over its target (:func:`store_for`), so a cache that never
            evicts stays exact; the hot tier's token count is planned as in full precision and the ladder gets the
            bytes it saves (without a ladder they stay unused; results/memory/README.md, "An INT8 hot tier under
            the target").
        hot_slack: when the hot tier goes over its budget, evict past it by this share of the tokens it keeps by
            rank (its budget less its protected tokens and sinks), so that the ranking and the compaction wait that
            many steps instead of running at every step; 0: evict to the budget. The bytes stay under the target
            (the hot tier only runs below its share, and the ladder takes what it leaves). It is the store's
            ``evict_slack`` as a share (:func:`store_for`): give one of the two (results/memory/slack/).
        open_bits: the top rung's open page (the tokens the hot tier let go, waiting for a page to fill): 16 in
            the model's dtype; 8 in INT8 per token and KV head (:mod:`confkv.tiers.cold_read`), about half the
            bytes, so that early in a run, where the open page is most of the target, fewer sealed pages are
            dropped (results/memory/README.md, "The open page in INT8"); 4 in 4 bits per token and KV head of its
            Hadamard-rotated channels, about a quarter.
        ladder_slack: when the ladder goes over its bytes, step pages down (or drop them) past that by this share
            of them, so that step-downs come several pages at a time every many steps instead of one page at most
            steps (each is a decode and an encode of the page); 0: to the bytes exactly. The target is held either
            way; the slack's bytes stay unused until the stream grows into them (results/memory/README.md,
            "The ladder's slack").
        offload: keep sealed pages in a memory-mapped file (the digests and metadata stay in RAM);
            ``offload_dir``: its directory (None: the system temp dir).
    """

    ladder: tuple[int, ...] = (8, 4, 3)
    hot_share: float = 0.2
    hot_tokens: int | None = None
    hot_split: str = "share"
    page_size: int = 64
    group_size: int = 64
    step_down_by: str = "heat"
    step_order: str = "error"
    unread_by: str = "age"
    format: str = "kivi"
    outlier_fraction: float = 0.01
    rotation_seed: int = 0
    seal_early: bool = True
    seal_before_drop: bool = False
    hot_int8_window: int | None = None
    hot_slack: float = 0.0
    open_bits: int = 16
    ladder_slack: float = 0.0
    offload: bool = False
    offload_dir: str | None = None

    def __post_init__(self) -> None:
        ladder = self.ladder
        _require(isinstance(ladder, tuple) and all(isinstance(b, int) and not isinstance(b, bool) for b in ladder),
                 "ladder", f"must be a tuple of bit widths, e.g. (8, 4, 3, 2), got {ladder!r}")
        _require(all(b in RUNG_BITS for b in ladder), "ladder",
                 f"every rung must be one of {RUNG_BITS}, got {ladder!r}")
        _require(all(a > b for a, b in zip(ladder, ladder[1:])), "ladder",
                 f"must be strictly decreasing (precision only steps down), got {ladder!r}")
        _require(isinstance(self.hot_share, (int, float)) and not isinstance(self.hot_share, bool)
                 and math.isfinite(self.hot_share) and 0.0 < self.hot_share <= 1.0, "hot_share",
                 f"must be a share of the bytes in (0, 1], got {self.hot_share!r}")
        _require(self.hot_tokens is None or (isinstance(self.hot_tokens, int) and not isinstance(self.hot_tokens, bool)
                                             and self.hot_tokens >= 1), "hot_tokens",
                 f"must be None or a positive number of tokens, got {self.hot_tokens!r}")
        _require(self.hot_split in HOT_SPLITS, "hot_split",
                 f"must be one of {', '.join(HOT_SPLITS)}, got {self.hot_split!r}")
        check_pages(self.page_size, self.group_size)
        _require(self.step_down_by in STEP_DOWN_SIGNALS, "step_down_by",
                 f"must be one of {', '.join(STEP_DOWN_SIGNALS)}, got {self.step_down_by!r}")
        _require(self.step_order in STEP_ORDERS, "step_order",
                 f"must be one of {', '.join(STEP_ORDERS)}, got {self.step_order!r}")
        _require(self.unread_by in UNREAD_ORDERS, "unread_by",
                 f"must be one of {', '.join(UNREAD_ORDERS)}, got {self.unread_by!r}")
        from confkv.config import ColdConfig  # noqa: PLC0415 - one place checks a page format

        ColdConfig(format=self.format, outlier_fraction=self.outlier_fraction, open_bits=self.open_bits,
                   rotation_seed=self.rotation_seed)
        for name in ("seal_early", "seal_before_drop"):
            _require(isinstance(getattr(self, name), bool), name, f"must be True or False, got {getattr(self, name)!r}")
        window = self.hot_int8_window
        _require(window is None or (isinstance(window, int) and not isinstance(window, bool) and window >= 0),
                 "hot_int8_window", "must be None (a full-precision hot tier; --param hot_int8_window=null) or a "
                 f"number of tokens >= 0 kept in full precision before the INT8 ones, e.g. 8; got {window!r}")
        slack = self.hot_slack
        _require(isinstance(slack, (int, float)) and not isinstance(slack, bool) and 0 <= slack < 1, "hot_slack",
                 f"must be a share of the hot tier's tokens kept by rank, at least 0 and below 1 (0: evict to the "
                 f"budget; e.g. 0.125), got {slack!r}")
        slack = self.ladder_slack
        _require(isinstance(slack, (int, float)) and not isinstance(slack, bool) and 0 <= slack < 1, "ladder_slack",
                 f"must be a share of the ladder's bytes, at least 0 and below 1 (0: to the bytes exactly; e.g. "
                 f"0.02), got {slack!r}")
        _require(isinstance(self.offload, bool), "offload", f"must be True or False, got {self.offload!r}")
        _require(not self.offload or bool(ladder), "offload", "needs a cold tier: give a non-empty ladder")
        if self.offload_dir is not None:
            import os  # noqa: PLC0415

            _require(os.path.isdir(self.offload_dir) and os.access(self.offload_dir, os.W_OK | os.X_OK),
                     "offload_dir", f"{self.offload_dir!r} is not a writable directory; create it or pass another")


def store_for(store: StoreConfig | None, storage: Storage | None) -> StoreConfig:
    """The store settings of a cache with ``storage``: ``store`` (default :class:`~confkv.config.StoreConfig`), with
    ``evict_slack=storage.hot_slack`` when that is not 0, and ``kv_int8=True, fp_window=W, int8_from="over_budget"``
    when ``storage.hot_int8_window`` is ``W``.

    Raises:
        ConfigError: ``store`` asks for another slack (``evict_slack`` not 0 and not ``hot_slack``) or another INT8
            store (``kv_int8=True`` with another window or start): two settings of one thing. (The store this
            returns is taken as it is: a fork's or a clone's.)
    """
    store = store or StoreConfig()
    if storage is None:
        return store
    if storage.hot_slack:
        _require(store.evict_slack in (0, storage.hot_slack), "hot_slack",
                 f"the storage evicts with a slack (hot_slack={storage.hot_slack}) and the store config asks for "
                 f"another (evict_slack={store.evict_slack}, --evict-slack); give one: drop evict_slack, or set "
                 "hot_slack=0 (--param hot_slack=0)")
        store = dataclasses.replace(store, evict_slack=storage.hot_slack)
    if storage.hot_int8_window is None:
        return store
    merged = dataclasses.replace(store, kv_int8=True, fp_window=storage.hot_int8_window, int8_from="over_budget")
    _require(not store.kv_int8 or store == merged, "hot_int8_window",
             f"the storage keeps its hot tier in INT8 (hot_int8_window={storage.hot_int8_window}) and the store "
             "config asks for INT8 too (kv_int8=True, --int8); give one: drop kv_int8 / --int8, or set "
             "hot_int8_window=None (--param hot_int8_window=null)")
    return merged


@dataclass(frozen=True)
class MemoryTarget:
    """The bytes a cache may hold at the end of every step, all layers and tiers counted.

    Exactly one of:

    - ``memory``: a fraction in (0, 1] of the bytes the full cache (transformers' ``DynamicCache``
      in the model's dtype) would hold at the current length;
    - ``max_kv_bytes``: an absolute cap, for streams of any length.

    Whatever the target, a cache never holds less than its *floor*: the sinks and protected
    recent tokens of every layer in full precision, plus sliding-window layers (Gemma-3). A
    fraction of a short prefix can be below it (the first few dozen tokens); a ``max_kv_bytes``
    below it is refused. What the target is in bytes at a given length is the planner's
    (:func:`confkv.tiers.planner.target_bytes`).
    """

    memory: float | None = None
    max_kv_bytes: int | None = None

    def __post_init__(self) -> None:
        _require((self.memory is None) != (self.max_kv_bytes is None), "memory",
                 "give exactly one of memory= (a fraction of the full cache's bytes) and max_kv_bytes= (a cap)")
        if self.memory is not None:
            _require(isinstance(self.memory, (int, float)) and not isinstance(self.memory, bool)
                     and math.isfinite(self.memory) and 0.0 < self.memory <= 1.0, "memory",
                     f"must be a fraction of the full cache's bytes in (0, 1], e.g. 0.25, got {self.memory!r}")
        else:
            _require(isinstance(self.max_kv_bytes, int) and not isinstance(self.max_kv_bytes, bool)
                     and self.max_kv_bytes >= 1, "max_kv_bytes",
                     f"must be a positive number of bytes, got {self.max_kv_bytes!r}")
