"""Validated configuration dataclasses, one per concern.

Bad values raise :class:`confkv.errors.ConfigError` (a ``ValueError``) at
construction, naming the field and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from confkv.errors import ConfigError


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{field_name}: {message}")


@dataclass(frozen=True)
class ConfidenceConfig:
    """Weights of the confidence score (METHOD.md step 1).

    ``c = w_entropy * (1 - H_norm) + w_margin * M(log p1 - log p2) + w_top * p1``,
    normalised by the sum of the weights so that ``c`` stays in [0, 1].

    ``margin_form`` chooses ``M``:

    - ``"centered"`` (default): ``M(m) = 2 * sigmoid(m) - 1``. The margin ``m`` is never
      negative, so the paper's literal ``sigmoid(m)`` lives in [0.5, 1) and adds a floor
      of ``0.5 * w_margin`` (0.15 with default weights) even to a uniform distribution.
      The centered form spans [0, 1) like the other two terms: a uniform distribution
      gives ``c ~ 0`` and a one-hot one ``c ~ 1``.
    - ``"sigmoid"``: the paper's literal ``sigmoid(m)``.
    """

    w_entropy: float = 0.4
    w_margin: float = 0.3
    w_top: float = 0.3
    margin_form: str = "centered"

    def __post_init__(self) -> None:
        for name in ("w_entropy", "w_margin", "w_top"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and math.isfinite(value), name, f"must be a finite number, got {value!r}")
            _require(value >= 0, name, f"must be >= 0, got {value}")
        _require(self.margin_form in ("centered", "sigmoid"), "margin_form",
                 f"must be 'centered' or 'sigmoid', got {self.margin_form!r}")
        _require(self.w_entropy + self.w_margin + self.w_top > 0, "w_entropy/w_margin/w_top",
                 "the confidence weights are all zero; give at least one a positive weight (default 0.4/0.3/0.3)")


@dataclass(frozen=True)
class StoreConfig:
    """How a layer stores its kept tokens and runs its prefill.

    - ``kv_int8``: keep tokens older than ``fp_window`` in INT8 (METHOD.md step 4).
    - ``fp_window`` (W): the most recent tokens kept in the model's precision.
    - ``int8_from`` (with ``kv_int8``): ``"start"`` (default, the paper's step 4: every token that leaves
      the FP window is stored in INT8) or ``"over_budget"``: the store keeps full precision until the
      first step it must evict (over its budget, or its cache over its memory target), then quantizes
      what it holds once and every later token, so a cache that never evicts stays exact.
    - ``prefill_chunk``: prompt tokens fed per forward pass by :func:`confkv.hf.prefill`;
      the cache is brought under budget after every chunk, so peak KV is budget + chunk.
    - ``block_size``: key block of the block-wise attention read.
    - ``move_block``: tokens move from the FP window to the older region in groups of
      this many, so the older region is rewritten once per ``move_block`` steps, not every step.
    - ``evict_slack`` (opt-in, default 0 = the paper's rule): when a layer goes over its
      budget, evict down to ``budget - evict_slack`` instead of ``budget``, so at a steady
      budget the compaction gather runs once per ``evict_slack + 1`` steps instead of every
      step. The budget is still never exceeded; the layer holds between ``budget - slack``
      and ``budget`` tokens (on average ``slack / 2`` fewer). It changes which tokens are
      kept: its quality effect at equal memory is recorded in ``results/bench/``. An integer
      is a number of tokens; a float in [0, 1) a share of the tokens the layer keeps by rank
      at that step (its budget less the protected tokens and sinks; ``0.125``: an eighth of
      them), which scales with a memory target's budget and takes nothing from a budget at its
      floor, where a fixed count takes the few ranked tokens there are
      (``results/memory/slack/``).
    - ``read_backend``: the attention read (:func:`confkv.attention.attention_read`):
      ``"auto"`` (default: Triton on CUDA; on CPU PyTorch's fused kernel where the read
      needs no mask, mass or INT8, else the block-wise read), ``"torch"`` (always the
      block-wise read, the reference) or ``"triton"`` (always the Triton read: CUDA, or
      the CPU interpreter under ``TRITON_INTERPRET=1``; it reads cold pages packed).
    """

    kv_int8: bool = False
    fp_window: int = 128
    int8_from: str = "start"
    prefill_chunk: int = 512
    block_size: int = 1024
    move_block: int = 32
    evict_slack: int | float = 0
    read_backend: str = "auto"

    def __post_init__(self) -> None:
        _require(self.read_backend in ("auto", "torch", "triton"), "read_backend",
                 f"must be 'auto', 'torch' or 'triton', got {self.read_backend!r}")
        _require(isinstance(self.kv_int8, bool), "kv_int8", f"must be True or False, got {self.kv_int8!r}")
        _require(self.int8_from in ("start", "over_budget"), "int8_from",
                 f"must be 'start' (INT8 from the first token past the FP window) or 'over_budget' (INT8 from the "
                 f"first step the store evicts), got {self.int8_from!r}")
        _require(self.kv_int8 or self.int8_from == "start", "int8_from",
                 "applies to an INT8 store only; give kv_int8=True with it (or leave int8_from='start')")
        slack = self.evict_slack
        _require(isinstance(slack, int) and not isinstance(slack, bool) and slack >= 0
                 or isinstance(slack, float) and 0.0 <= slack < 1.0, "evict_slack",
                 f"must be a number of tokens (an integer >= 0) or a share of the tokens kept by rank (a float between 0 "
                 f"and 1, e.g. 0.125), got {slack!r}")
        for name, low in (("fp_window", 0), ("prefill_chunk", 1), ("block_size", 1), ("move_block", 1)):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {value!r}")
            _require(value >= low, name, f"must be >= {low}, got {value}")


@dataclass(frozen=True)
class GateConfig:
    """The confidence gate (METHOD.md step 2): ``c >= tau`` -> ``n_high`` (tight), else ``n_low`` (loose).

    ``smoothing`` (default 0, the paper's per-step gate) gates on an exponential moving
    average of the confidence instead, ``g_t = smoothing * g_{t-1} + (1 - smoothing) * c_t``.
    Measured on SmolLM2 (docs/EVALUATION.md, "The sawtooth"), the raw per-step confidence swings
    across ``tau`` almost every step; since evicted tokens never come back, the cache can
    only grow by one token per uncertain step and is cut back at the next confident one,
    so a per-step gate stays close to ``n_high``. Smoothing gives the gate longer
    uncertain and confident stretches.
    """

    tau: float = 0.5
    n_high: int = 256
    n_low: int = 512
    smoothing: float = 0.0
    confidence: ConfidenceConfig = field(default_factory=ConfidenceConfig)

    def __post_init__(self) -> None:
        _require(isinstance(self.tau, (int, float)) and 0.0 <= self.tau <= 1.0, "tau",
                 f"must be in [0, 1] (confidence is in [0, 1]), got {self.tau!r}")
        for name in ("n_high", "n_low"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                     f"must be a positive integer number of tokens, got {value!r}")
        _require(isinstance(self.smoothing, (int, float)) and 0.0 <= self.smoothing < 1.0, "smoothing",
                 f"must be in [0, 1), got {self.smoothing!r}")
        _require(self.n_high <= self.n_low, "n_high",
                 f"the tight (confident) budget n_high={self.n_high} must be <= the loose budget n_low={self.n_low}")


def check_pages(page_size: int, group_size: int) -> None:
    """Raise :class:`ConfigError` unless ``page_size`` and ``group_size`` are positive integers and the group
    divides the page (cold pages: :class:`ColdConfig`, :class:`confkv.tiers.storage.Storage`)."""
    for name, value in (("page_size", page_size), ("group_size", group_size)):
        _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                 f"must be a positive integer, got {value!r}")
    _require(page_size % group_size == 0, "group_size", f"must divide page_size={page_size}, got {group_size}")


#: page counts meaning "read every cold page" (the KIVI anchor)
ALL_PAGES = 2**31


#: widths a cold tier's open page may have: 16 = the model's dtype (exact), 8 = INT8 codes per token and KV head
OPEN_BITS = (16, 8, 4)


@dataclass(frozen=True)
class ColdConfig:
    """The cold tier of a tiered store (issue "keep every token"): evicted tokens are demoted, not deleted.

    - ``bits``: 2, 3, 4 or 8 (KIVI-style: keys per channel in groups of ``group_size`` tokens,
      values per token in groups of ``group_size`` channels; float16 scales), or 16 = kept in
      the model's dtype, unquantized (the Quest anchor).
    - ``page_size``: tokens per page; each page carries a key digest (per-channel min/max,
      Quest) that bounds ``q . k`` for any query. Demoted tokens wait in an FP "open page"
      (read in full every step, like KIVI's residual) until a page fills.
    - ``group_size``: quantization group (tokens for keys, channels for values); divides ``page_size``.
    - ``k_high`` / ``k_low``: cold pages read per step when the model is confident
      (``c >= tau``) / uncertain. Equal values give a fixed read budget; ``k_high > k_low``
      is the inverted gate. ``"all"`` reads every page (held as :data:`ALL_PAGES`).
    - ``cold_budget``: most tokens the cold tier holds per sequence (None: unbounded); the
      coldest pages (least attention per read since sealing; pages not yet read stay; among
      equals the oldest) are evicted for good.
    - ``offload``: keep sealed pages in a memory-mapped file (RAM keeps the digests);
      ``offload_dir``: its directory (None: the system temp dir).
    - ``promote`` (None: off): when, at a decode step, a read page's tokens received at least
      this share of the attention (summed over the page, averaged over a KV group's query
      heads) in some head, every head moves its most-attended read page back to the hot tier;
      the hot tier then demotes its lowest-ranked tokens at the step's end. Tokens can come
      back. Needs a policy that reads attention mass (``confkv-r``).
    - ``format``: how sealed pages are stored (:mod:`confkv.tiers.formats`): ``"kivi"`` (plain
      KIVI, the default) or ``"kivi"`` plus techniques joined by ``+``: ``hadamard`` (rotated
      channels), ``outliers`` (the most extreme entries kept in 16 bits), ``codebook``
      (non-uniform levels per layer), ``prerope`` (keys stored before the rotary embedding),
      ``channel_bits`` (each key channel at its own width, the same bytes), e.g. ``"hadamard+codebook"``.
      Ignored at ``bits=16``.
    - ``outlier_fraction``: with ``outliers``, the share of each page's entries kept apart.
    - ``value_bits``: values at this width (2, 3, 4 or 8) while keys stay at ``bits`` (None: values at
      ``bits`` too). Keys decide which tokens a query finds and carry more of the loss, so 4-bit keys with
      2-bit values cost what 3 bits each cost and lose less (results/lowbit/README.md, "Keys at 4 bits,
      values at 2"). The native page read takes pages of two widths packed; the Triton read leaves them to
      the torch read.
    - ``open_bits``: the open page's storage: 16 = the model's dtype (exact), 8 = INT8 codes per token and KV
      head (:mod:`confkv.tiers.cold_read`; about half the bytes, under a memory target), 4 = 4-bit codes per token
      and KV head of its Hadamard-rotated channels (about a quarter; head_dim even).
    - ``rotation_seed``: with ``hadamard``, the seed of the rotation's random signs. Every seed is an equally good
      rotation; runs at several seeds measure a format's loss apart from the chance of one rotation
      (results/lowbit/README.md, "One rotation or another").
    """

    bits: int = 2
    page_size: int = 32
    group_size: int = 32
    k_high: int | str = 4
    k_low: int | str = 16
    cold_budget: int | None = None
    offload: bool = False
    offload_dir: str | None = None
    promote: float | None = None
    format: str = "kivi"
    outlier_fraction: float = 0.01
    value_bits: int | None = None
    open_bits: int = 16
    rotation_seed: int = 0

    def __post_init__(self) -> None:
        from confkv.tiers.format_names import parse_format  # noqa: PLC0415

        try:
            parse_format(self.format)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        _require(isinstance(self.outlier_fraction, (int, float)) and not isinstance(self.outlier_fraction, bool)
                 and 0.0 <= self.outlier_fraction <= 0.25, "outlier_fraction",
                 f"must be a share of a page's entries in [0, 0.25], got {self.outlier_fraction!r}")
        _require(self.bits in (2, 3, 4, 8, 16) and not isinstance(self.bits, bool), "bits",
                 f"must be one of 2, 3, 4, 8 (KIVI-style) or 16 (unquantized), got {self.bits!r}")
        _require(self.open_bits in OPEN_BITS and not isinstance(self.open_bits, bool), "open_bits",
                 f"must be 16 (the model's dtype), 8 (INT8 per token) or 4 (4 bits per token, rotated), "
                 f"got {self.open_bits!r}")
        _require(isinstance(self.rotation_seed, int) and not isinstance(self.rotation_seed, bool)
                 and 0 <= self.rotation_seed < 2 ** 63, "rotation_seed",
                 f"must be a whole number in [0, 2**63), the seed of the Hadamard rotation's signs, "
                 f"got {self.rotation_seed!r}")
        if self.value_bits is not None:
            _require(self.value_bits in (2, 3, 4, 8) and not isinstance(self.value_bits, bool), "value_bits",
                     f"must be None (values at bits) or one of 2, 3, 4, 8, got {self.value_bits!r}")
            _require(self.bits != 16, "value_bits",
                     "applies to quantized pages only; with bits=16 leave it None")
        check_pages(self.page_size, self.group_size)
        for name in ("k_high", "k_low"):
            value = getattr(self, name)
            if value == "all":
                object.__setattr__(self, name, ALL_PAGES)
                continue
            _require(isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= ALL_PAGES, name,
                     f"must be a number of pages in [0, {ALL_PAGES}] or \"all\" (every page), got {value!r}")
        if self.cold_budget is not None:
            _require(isinstance(self.cold_budget, int) and not isinstance(self.cold_budget, bool)
                     and self.cold_budget >= self.page_size, "cold_budget",
                     f"must be None (unbounded) or a number of tokens >= page_size={self.page_size}, "
                     f"got {self.cold_budget!r}")
            for name in ("k_high", "k_low"):
                value = getattr(self, name)
                _require(value == ALL_PAGES or value * self.page_size <= self.cold_budget, name,
                         f"reads {value} pages of {self.page_size} tokens, more than cold_budget={self.cold_budget} "
                         f"tokens can hold; lower it, raise cold_budget, or read every page with \"all\"")
        _require(isinstance(self.offload, bool), "offload", f"must be True or False, got {self.offload!r}")
        _require(self.promote is None or (isinstance(self.promote, (int, float)) and not isinstance(self.promote, bool)
                                          and 0.0 < self.promote <= 1.0), "promote",
                 f"must be None (off) or an attention share in (0, 1], got {self.promote!r}")
        if self.offload_dir is not None:
            import os  # noqa: PLC0415

            _require(os.path.isdir(self.offload_dir) and os.access(self.offload_dir, os.W_OK | os.X_OK),
                     "offload_dir", f"{self.offload_dir!r} is not a writable directory; create it or pass another")

    @property
    def needs_digest(self) -> bool:
        """Whether pages carry a key digest: not when every read takes every page (KIVI)."""
        return not (self.k_high == ALL_PAGES and self.k_low == ALL_PAGES)
