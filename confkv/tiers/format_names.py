"""The names of the cold tier's page formats: ``"kivi"``, or ``"kivi"`` plus techniques joined by ``+``.

Parsing and checking a name, and writing it in one order, live here so that a name can be checked (a config, the
command line) without building a format; :mod:`confkv.tiers.formats` builds the formats themselves.
"""

from __future__ import annotations

#: the techniques a format may add to KIVI
TECHNIQUES = ("hadamard", "outliers", "codebook", "prerope", "clip", "channel_bits")
#: techniques that change only how codes are chosen, not what is stored or how it is read
STORAGE_NEUTRAL = frozenset({"clip"})


def parse_format(name: str) -> frozenset[str]:
    """The techniques of format ``name`` ("kivi", or "kivi"/techniques joined by "+").

    Raises:
        ValueError: an unknown part, naming the known ones.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"format: must be a non-empty string, got {name!r}")
    parts = [part.strip() for part in name.split("+")]
    unknown = [part for part in parts if part not in TECHNIQUES and part != "kivi"]
    if unknown:
        raise ValueError(f"format: unknown part(s) {', '.join(map(repr, unknown))} in {name!r}; known: 'kivi', "
                         f"or 'kivi' plus any of {', '.join(map(repr, TECHNIQUES))} joined by '+' "
                         "(e.g. 'hadamard+outliers')")
    techniques = frozenset(part for part in parts if part != "kivi")
    check_combination(techniques)
    return techniques


def check_combination(techniques: frozenset[str]) -> None:
    """Raises ValueError, naming the fix, for techniques that cannot go together."""
    if {"channel_bits", "codebook"} <= techniques:
        raise ValueError("format: 'channel_bits' sets each key channel's levels by its width; it cannot be "
                         "combined with 'codebook': drop one of them")


def canonical_name(techniques: frozenset[str]) -> str:
    """``"kivi"`` and the techniques in :data:`TECHNIQUES`' order, joined by ``+``."""
    return "+".join(["kivi", *[t for t in TECHNIQUES if t in techniques]])
