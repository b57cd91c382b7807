"""Page formats of the cold tier: how a page of keys and values is encoded, decoded and counted.

One interface for every storage of a sealed page (:class:`PageFormat`), built per layer by
:func:`build_format` from the tier's :class:`~confkv.config.ColdConfig` (``bits``,
``group_size``, ``format``, ``outlier_fraction``) and the layer's facts (head dim, dtype,
rotary parameters)::

    fmt.encode(keys, values, valid, positions) -> dict[str, Tensor]   # every tensor [B, H, N, ...]
    fmt.decode(data, positions) -> (keys, values)                      # float32 [B, H, N, P, D]
    fmt.page_nbytes(kv_heads, head_dim, page_size) -> int              # one page, one sequence, all heads
    fmt.layer_nbytes() -> int                                          # per-layer state (codebooks)

``keys`` / ``values`` are [B, H, N, P, D] (``N`` pages of ``P`` tokens), ``valid`` [B, H, N, P]
bool, ``positions`` [B, H, N, P] int64 (the tokens' original positions). Every stored tensor
leads with [B, H, N] so pages can be gathered and moved along dim 2 by index. ``page_nbytes``
counts every side byte (scales, minima, outlier values and indices); the Quest digest is the
tier's, not the format's, and is not included.

Formats (``ColdConfig.format``): ``"kivi"`` (plain KIVI, :mod:`confkv.tiers.lowbit`; with ``hadamard``
the only format the Triton paged read takes packed) or ``"kivi"`` plus any of the techniques below joined by
``+`` (order free; ``"hadamard+outliers"`` is ``"kivi+outliers+hadamard"``):

- ``hadamard``: a randomized Hadamard rotation of each head's channels, keys and values
  (:mod:`confkv.tiers.hadamard`); decoded back to the original basis, or read in it. ``kivi+hadamard``
  stores KIVI codes of the rotated keys and values, so the native page read takes its pages
  packed (:attr:`PageFormat.paged_when_rotated`; the kernel turns the query into their basis).
- ``outliers``: ``outlier_fraction`` of each page's entries kept apart in 16 bits, as corrections
  to their decoded entries (:mod:`confkv.tiers.outliers`), which every read adds.
- ``codebook``: non-uniform levels, one k-means codebook per layer and tensor
  (:mod:`confkv.tiers.codebook`).
- ``prerope``: keys stored before the rotary embedding, re-rotated at decode from each
  token's position (:mod:`confkv.tiers.prerope`; needs the model's rotary parameters).
- ``clip``: at 2 and 3 bits, each group's range chosen by least squared error instead of its minimum and
  maximum (:mod:`confkv.tiers.clipping`); the stored form is KIVI's, so it reads as the format without it
  (``kivi+clip`` as ``kivi``, ``kivi+hadamard+clip`` as ``kivi+hadamard``). It lowers perplexity and loses
  exact recall: on the 8/4/3 ladder at 25% it found 10 of 20 needles at 4K where the preset found 16 of the same 20
  (results/memory/README.md, "Points 2 and 3 (stop 38)"), so no preset uses it.
- ``channel_bits``: each key channel of a page at its own width, the page's key bits shared out by the error they
  remove (:mod:`confkv.tiers.channel_bits`; the widths stored with the page, at most KIVI's bytes at ``bits``). The
  keys are never rotated (with ``hadamard`` only the values are, with ``clip`` only the values' ranges are clipped).
  The native page read takes the pages packed (their widths carried by the segment, ``c/page_widths.c``; with
  ``hadamard`` the kernel turns only their values' share of the output back); no rotation is folded into a read
  of them. Not with ``codebook`` (a channel's levels are set by its width).

At ``bits=16`` every format is the unquantized page in the model's dtype (:class:`FullPrecisionFormat`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from confkv.native import page_encode
from confkv.tiers import lowbit
from confkv.tiers import channel_bits as _channel_bits, clipping as _clipping, codebook as _codebook
from confkv.tiers import outliers as _outliers
from confkv.tiers.format_names import STORAGE_NEUTRAL, TECHNIQUES, canonical_name, check_combination, parse_format
from confkv.tiers.hadamard import shared_rotation

#: the techniques whose pages the C codec (confkv/native/page_encode.py) encodes and decodes: those that only change
#: the basis before quantizing (done in torch around the call)
_NATIVE_CODEC = frozenset({"hadamard", "prerope"})
#: the storage of plain KIVI pages (what :class:`~confkv.attention.segments.PagedSegment` reads)
KIVI_STORAGE = ("key_codes", "key_scale", "key_min", "value_codes", "value_scale", "value_min")


class PageFormat:
    """The storage of one layer's sealed pages (see the module docstring).

    Attributes:
        name: the canonical format name ("kivi", "kivi+hadamard", ..., "fp16").
        bits: code width (16: unquantized).
        paged: True when :class:`~confkv.attention.segments.PagedSegment` carries the storage as it is (KIVI
            codes, maybe of two widths, maybe with outliers); otherwise reads decode with :meth:`decode`.
        paged_when_rotated: True when the storage is such KIVI codes in the basis of :attr:`read_rotation`
            (``kivi+hadamard``, ``+outliers``): a packed read takes it either in that basis (the read folds the rotation
            into the query and output) or with the rotation attached (:attr:`PagedSegment.rotation`: the
            native read turns the query itself).
        storage: the names :meth:`encode` returns.
    """

    name = "abstract"
    bits = 0
    paged = False
    paged_when_rotated = False
    storage: tuple[str, ...] = ()

    def encode(self, keys: Tensor, values: Tensor, valid: Tensor, positions: Tensor | None) -> dict[str, Tensor]:
        raise NotImplementedError

    def decode(self, data: dict[str, Tensor], positions: Tensor | None,
               rotated: bool = False) -> tuple[Tensor, Tensor]:
        """Keys, values float32 [B, H, N, P, D]; ``rotated`` (only where :attr:`read_rotation` is
        not None): left in that rotation's basis, for a read that rotates the query and the output."""
        raise NotImplementedError

    #: a rotation a read may fold into the query and output instead of decoding each page back (see
    #: :meth:`decode`'s ``rotated``), or None (a plain attribute: the read asks for it every step)
    read_rotation: Any = None

    def page_nbytes(self, kv_heads: int, head_dim: int, page_size: int) -> int:
        raise NotImplementedError

    def layer_nbytes(self) -> int:
        """Bytes of per-layer state (codebooks); 0 for formats without any."""
        return 0

    def check(self, data: dict[str, Tensor]) -> None:
        """Raise ValueError unless ``data`` holds this format's storage."""
        missing = [name for name in self.storage if name not in data]
        if missing:
            raise ValueError(f"page format {self.name!r}: the pages lack {', '.join(missing)} (pages of another "
                             "format cannot be decoded by this one)")


class FullPrecisionFormat(PageFormat):
    """16-bit pages: keys and values in the model's dtype, no side data."""

    name = "fp16"
    bits = 16
    paged = True
    storage = ("keys", "values")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def encode(self, keys, values, valid, positions=None):
        return {"keys": keys.to(self.dtype), "values": values.to(self.dtype)}

    def decode(self, data, positions=None, rotated=False):
        self.check(data)
        return data["keys"].float(), data["values"].float()

    def page_nbytes(self, kv_heads, head_dim, page_size):
        return 2 * kv_heads * page_size * head_dim * torch.empty((), dtype=self.dtype).element_size()


class KiviFormat(PageFormat):
    """KIVI pages (keys per channel in groups of ``group_size`` tokens, values per token in groups
    of ``min(group_size, head_dim)`` channels, float16 scales and minima), with optional techniques.

    Args:
        bits: 2, 3, 4 or 8 (the keys' width, and the values' unless ``value_bits`` is given).
        group_size: the KIVI group.
        head_dim: channels per KV head.
        techniques: a subset of :data:`TECHNIQUES`.
        outlier_fraction: with ``outliers``, the share of each page's entries kept apart.
        rope: with ``prerope``, the model's :class:`~confkv.tiers.prerope.Rope`.
        value_bits: the values' width (None: ``bits``). Pages of two widths, and pages with outliers, are read
            packed by the native page read; the Triton read hands them to the torch read (read_plan).
        rotation_seed: with ``hadamard``, the seed of the rotation's random signs (:func:`shared_rotation`).
    """

    def __init__(self, bits: int, group_size: int, head_dim: int, techniques: frozenset[str] = frozenset(),
                 outlier_fraction: float = 0.01, rope: Any = None, value_bits: int | None = None,
                 rotation_seed: int = 0) -> None:
        self.widths = {"key": bits, "value": bits if value_bits is None else value_bits}
        for width in self.widths.values():
            lowbit.check_packable(head_dim, width)
        if head_dim % min(group_size, head_dim):
            raise ValueError(f"group_size: must divide head_dim={head_dim} (values are grouped by channels), "
                             f"got {group_size}")
        unknown = set(techniques) - set(TECHNIQUES)
        if unknown:
            raise ValueError(f"format: unknown techniques {sorted(unknown)}; known: {TECHNIQUES}")
        self.bits, self.group_size, self.head_dim = bits, group_size, head_dim
        self.techniques = frozenset(techniques)
        check_combination(self.techniques)
        self.name = canonical_name(self.techniques)
        # what changes the pages' storage or read beyond what a PagedSegment carries (outliers, two widths and
        # per-channel key widths it carries: the native page read takes them, the Triton read leaves them to the
        # torch read)
        stored = self.techniques - STORAGE_NEUTRAL - {"outliers", "channel_bits"}
        self.paged = not stored
        self.paged_when_rotated = stored == frozenset({"hadamard"})  # KIVI codes of rotated K / V
        self.outlier_fraction = outlier_fraction
        self.rotation = shared_rotation(head_dim, rotation_seed) if "hadamard" in techniques else None
        self.rope = rope if "prerope" in techniques else None
        self._needs_rope = "prerope" in techniques  # checked at encode/decode (sizes need no rope)
        # pre-RoPE keys must come back to turn; per-channel widths leave the keys unrotated (no common basis)
        self.read_rotation = None if self._needs_rope or "channel_bits" in techniques else self.rotation
        self.levels: dict[str, Tensor | None] = {"key": None, "value": None}  # fitted codebooks
        self._tables: dict[tuple[str, torch.device], Tensor] = {}
        names = list(KIVI_STORAGE)
        if "outliers" in techniques:
            names += ["key_outlier_index", "key_outlier_value", "value_outlier_index", "value_outlier_value"]
        if "channel_bits" in techniques:
            names.append("key_widths")
        self.storage = tuple(names)

    # -- sizes ------------------------------------------------------------------------------------
    def outliers_per_page(self, page_size: int) -> int:
        if "outliers" not in self.techniques:
            return 0
        return _outliers.outlier_count(self.outlier_fraction, page_size, self.head_dim)

    def page_nbytes(self, kv_heads, head_dim, page_size):
        total = lowbit.page_bytes(kv_heads, head_dim, page_size, self.bits, self.group_size, digest=False)
        if self.widths["value"] != self.bits:  # the value codes at their own width; scales and minima alike
            total += kv_heads * page_size * (lowbit.packed_width(head_dim, self.widths["value"])
                                             - lowbit.packed_width(head_dim, self.bits))
        if "channel_bits" in self.techniques:  # each token's codes shorter; the page's widths a byte a channel
            shorter = lowbit.packed_width(head_dim, self.bits) - _channel_bits.row_bytes(self.bits, head_dim, page_size)
            total += kv_heads * (head_dim - page_size * shorter)
        return total + 2 * kv_heads * self.outliers_per_page(page_size) * _outliers.ENTRY_BYTES

    def layer_nbytes(self):
        if "codebook" not in self.techniques:
            return 0
        levels = sum(1 << width for width in self.widths.values())
        return levels * torch.empty((), dtype=_codebook.LEVEL_DTYPE).element_size()

    # -- encode -----------------------------------------------------------------------------------
    def _check_rope(self) -> None:
        if self._needs_rope and self.rope is None:
            raise ValueError("format: 'prerope' needs the model's rotary parameters; build the cache with "
                             "ConfKVCache.for_model (which passes them) or drop 'prerope'")

    def _basis(self, keys: Tensor, values: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor]:
        """Keys and values in the basis they are quantized in (float32)."""
        self._check_rope()
        keys, values = keys.float(), values.float()
        if self.rope is not None:
            keys = self.rope.unrotate(keys, _need_positions(positions))
        if self.rotation is not None:
            values = self.rotation.forward(values)
            if "channel_bits" not in self.techniques:
                keys = self.rotation.forward(keys)
        return keys, values

    def encode(self, keys, values, valid, positions=None):
        if self.techniques <= _NATIVE_CODEC:  # the codes after the change of basis in one C call, where it runs
            basis = (self._basis(keys, values, positions) if self.techniques
                     else (keys.detach().float(), values.detach().float()))
            native = page_encode.encode_kivi(*basis, valid, self.widths["key"], self.widths["value"],
                                             self.group_size, min(self.group_size, self.head_dim))
            if native is not None:
                return native
        if not self.techniques:
            qk = lowbit.quantize_keys(keys, valid, self.widths["key"], self.group_size)
            qv = lowbit.quantize_values(values, self.widths["value"], self.group_size)
            return dict(key_codes=qk.codes, key_scale=qk.scale, key_min=qk.minimum,
                        value_codes=qv.codes, value_scale=qv.scale, value_min=qv.minimum)
        keys, values = self._basis(keys, values, positions)
        batch, heads, count, page, dim = keys.shape
        group, vgroup = self.group_size, min(self.group_size, dim)
        # keys: groups of `group` tokens per channel (axis -2); values: groups of `vgroup` channels per token (axis -1)
        key_grouped = keys.reshape(batch, heads, count, page // group, group, dim)
        key_valid = valid.reshape(batch, heads, count, page // group, group, 1).expand_as(key_grouped)
        value_grouped = values.reshape(batch, heads, count, page, dim // vgroup, vgroup)
        value_valid = torch.ones_like(value_grouped, dtype=torch.bool)
        out: dict[str, Tensor] = {}
        kept, outlying = {"key": key_valid, "value": value_valid}, {}
        per_page = self.outliers_per_page(page)
        if per_page:
            _outliers.check_indexable(page, dim)
            for which, grouped, axis in (("key", key_grouped, -2), ("value", value_grouped, -1)):
                outlying[which], picked = _outliers.pick(grouped, kept[which], axis, per_page)
                out[f"{which}_outlier_index"] = outlying[which].to(_outliers.INDEX_DTYPE)
                kept[which] = kept[which] & ~picked
        for which, grouped, axis in (("key", key_grouped, -2), ("value", value_grouped, -1)):
            if which == "key" and "channel_bits" in self.techniques:
                width_bytes = _channel_bits.row_bytes(self.bits, dim, page)
                widths = _channel_bits.allocate(_channel_bits.page_width_errors(grouped, kept["key"]), 8 * width_bytes)
                codes, scale, minimum = _channel_bits.quantize_groups(grouped, kept["key"],
                                                                      widths[:, :, :, None, None, :], axis)
                out["key_codes"] = _channel_bits.pack(codes.reshape(batch, heads, count, page, dim), widths,
                                                      width_bytes)
                out["key_widths"] = widths.to(torch.uint8)
            else:
                codes, scale, minimum = self._quantize(which, grouped, kept[which], axis)
                out[f"{which}_codes"] = lowbit.pack(codes.reshape(batch, heads, count, page, dim),
                                                    self.widths[which])
            out[f"{which}_scale"], out[f"{which}_min"] = scale.squeeze(axis), minimum.squeeze(axis)
            if which in outlying:  # each outlier's correction: the entry less what its codes decode to
                levels = codes if self.levels[which] is None else self.levels[which].to(codes.device)[codes.long()]
                decoded = _channel_bits.dequantize_groups(levels, scale, minimum)  # min + code * scale, float32
                out[f"{which}_outlier_value"] = _outliers.corrections(grouped, decoded, outlying[which])
        return out

    def _quantize(self, which: str, x: Tensor, mask: Tensor, axis: int) -> tuple[Tensor, Tensor, Tensor]:
        """Asymmetric codes of ``x`` over ``axis`` (range from the ``mask`` entries) at ``which``'s width:
        codes uint8, scale, min float16."""
        bits = self.widths[which]
        bottom, top = lowbit.masked_extremes(x, mask, axis)
        if "clip" in self.techniques and bits <= _clipping.MAX_BITS:
            bottom, top = _clipping.clipped_range(x, mask, axis, bottom, top, bits)
        scale, minimum = lowbit.scale_and_minimum(bottom, top, bits)
        u = lowbit.levels_in_range(x, scale, minimum, bits)
        if "codebook" in self.techniques:
            if self.levels[which] is None:  # the layer's first pages calibrate its codebook
                self.levels[which] = _codebook.fit_levels(u[mask], bits)
            codes = _codebook.nearest(u, self.levels[which].to(u.device))
        else:
            codes = torch.round(u)
        return codes.to(torch.uint8), scale, minimum

    # -- decode -----------------------------------------------------------------------------------
    def _codes(self, which: str, packed: Tensor) -> Tensor:
        """[..., packed] uint8 -> [..., D] float32 levels (code values for even levels), at ``which``'s width."""
        bits, levels = self.widths[which], self.levels[which]
        if levels is None:
            return lowbit.unpack_float(packed, bits, self.head_dim)
        key = (which, packed.device)
        if key not in self._tables:
            self._tables[key] = lowbit.code_table(bits, levels, packed.device)
        return lowbit.lookup_codes(packed, bits, self.head_dim, self._tables[key])

    def decode(self, data, positions=None, rotated=False):
        if rotated and self.read_rotation is None:
            raise ValueError(f"format {self.name!r}: no rotation to leave the pages in")
        self._check_rope()
        self.check(data)
        if "codebook" in self.techniques and self.levels["key"] is None:
            raise ValueError("format: codebook pages decoded before any page was encoded (no codebook fitted)")
        native = (page_encode.decode_kivi(data, self.widths["key"], self.widths["value"], self.group_size,
                                          min(self.group_size, self.head_dim))
                  if self.techniques <= _NATIVE_CODEC else None)
        keys, values = native if native is not None else self._decoded(data)
        if self.rotation is not None and not rotated:  # (per-channel widths: the keys were not rotated)
            values = self.rotation.inverse(values)
            keys = keys if "channel_bits" in self.techniques else self.rotation.inverse(keys)
        if self.rope is not None:
            keys = self.rope.rotate(keys, _need_positions(positions))
        return keys, values

    def _decoded(self, data: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Keys and values [..., P, D] float32 in the pages' basis, by torch."""
        key_codes = (_channel_bits.unpack(data["key_codes"], data["key_widths"]) if "channel_bits" in self.techniques
                     else self._codes("key", data["key_codes"]))
        *lead, page, dim = key_codes.shape
        group, vgroup = self.group_size, min(self.group_size, dim)
        grouped = key_codes.reshape(*lead, page // group, group, dim)
        keys = torch.addcmul(data["key_min"].unsqueeze(-2).float(), grouped,
                             data["key_scale"].unsqueeze(-2).float()).reshape(*lead, page, dim)
        grouped = self._codes("value", data["value_codes"]).reshape(*lead, page, dim // vgroup, vgroup)
        values = torch.addcmul(data["value_min"].unsqueeze(-1).float(), grouped,
                               data["value_scale"].unsqueeze(-1).float()).reshape(*lead, page, dim)
        if "outliers" in self.techniques:
            keys = _outliers.restore(keys, data["key_outlier_index"], data["key_outlier_value"])
            values = _outliers.restore(values, data["value_outlier_index"], data["value_outlier_value"])
        return keys, values


def _need_positions(positions: Tensor | None) -> Tensor:
    if positions is None:
        raise ValueError("format: 'prerope' pages need the tokens' positions to encode and decode")
    return positions


def build_format(bits: int, group_size: int, head_dim: int, dtype: torch.dtype, format: str = "kivi",
                 outlier_fraction: float = 0.01, rope: Any = None, value_bits: int | None = None,
                 rotation_seed: int = 0) -> PageFormat:
    """The page format of one layer (``bits`` 16: :class:`FullPrecisionFormat`, whatever ``format``).

    Raises:
        ValueError: an unknown format (naming the known ones) or a shape it cannot pack.
    """
    techniques = parse_format(format)
    if bits == 16:
        return FullPrecisionFormat(dtype)
    return KiviFormat(bits, group_size, head_dim, techniques, outlier_fraction=outlier_fraction, rope=rope,
                      value_bits=value_bits, rotation_seed=rotation_seed)


def format_for(config: Any, head_dim: int, dtype: torch.dtype, rope: Any = None) -> PageFormat:
    """:func:`build_format` from a :class:`~confkv.config.ColdConfig`."""
    return build_format(config.bits, config.group_size, head_dim, dtype, config.format,
                        config.outlier_fraction, rope, config.value_bits, config.rotation_seed)
