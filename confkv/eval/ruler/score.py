"""RULER's scoring (Hsieh et al., 2024, arXiv:2404.06654; as lm-evaluation-harness 0.4.13 implements it).

- :func:`string_match_all` (NIAH, variable tracking, common/frequent words): the fraction of
  the reference strings that occur in the prediction, case-insensitive; 1.0 only if all do.
- :func:`string_match_part` (QA): 1.0 if any reference occurs.

A prediction is first cleaned as RULER does: stripped, control characters turned into
newlines. Scores are in [0, 1] per sample; tables report 100 x the mean.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(prediction: str) -> str:
    """Strip, then replace control characters by newlines (RULER's ``postprocess_pred``)."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of ``references`` found in ``prediction`` (case-insensitive substring)."""
    if not references:
        raise ValueError("string_match_all: a sample needs at least one reference string")
    text = postprocess_pred(prediction).lower()
    return sum(1.0 for r in references if r.lower() in text) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1.0 if any of ``references`` occurs in ``prediction`` (case-insensitive), else 0.0."""
    if not references:
        raise ValueError("string_match_part: a sample needs at least one reference string")
    text = postprocess_pred(prediction).lower()
    return 1.0 if any(r.lower() in text for r in references) else 0.0


def ruler_score(prediction: str, references: list[str], metric: str = "all") -> float:
    """Score one sample with RULER's metric ``"all"`` or ``"part"``."""
    if metric == "all":
        return string_match_all(prediction, references)
    if metric == "part":
        return string_match_part(prediction, references)
    raise ValueError(f"RULER metric {metric!r}: choose 'all' or 'part'")


__all__ = ["postprocess_pred", "ruler_score", "string_match_all", "string_match_part"]
