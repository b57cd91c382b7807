"""Named presets: a ranking policy and a storage that go well together under a memory target.

``ConfKVCache.for_model(model)`` (no policy, no memory) takes :data:`DEFAULT_PRESET` at
:data:`DEFAULT_MEMORY`; ``for_model(model, memory=0.125)`` the same preset at another target;
``for_model(model, "tiered", ...)`` names it. The figures behind each choice are in
``results/memory/README.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from confkv.tiers.storage import Storage

DEFAULT_MEMORY = 0.25


@dataclass(frozen=True)
class Preset:
    """A ranking policy (registry name and parameters) with its storage."""

    policy: str
    storage: Storage
    params: dict[str, Any] = field(default_factory=dict)
    summary: str = ""


PRESETS: dict[str, Preset] = {
    "tiered": Preset(
        policy="confkv-fixed", storage=Storage(ladder=(8, 4, 3, 2), hot_share=0.2, page_size=64, group_size=64,
                                               step_down_by="heat"),
        summary="CONF-KV's EMA ranking for a full-precision hot tier; every other token on a 8/4/3/2-bit ladder"),
    "kivi-4": Preset(
        policy="window", storage=Storage(ladder=(4,), hot_tokens=128, page_size=64, group_size=64, step_down_by="age"),
        summary="KIVI under a target: 128 recent tokens in full precision, older ones 4-bit, the oldest dropped"),
    "kivi-2": Preset(
        policy="window", storage=Storage(ladder=(2,), hot_tokens=128, page_size=64, group_size=64, step_down_by="age"),
        summary="KIVI under a target: 128 recent tokens in full precision, older ones 2-bit, the oldest dropped"),
}
DEFAULT_PRESET = "tiered"

STORAGE_FIELDS = tuple(f.name for f in dataclasses.fields(Storage))


def split_storage_params(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``params`` -> (policy parameters, :class:`Storage` fields)."""
    storage = {k: v for k, v in params.items() if k in STORAGE_FIELDS}
    return {k: v for k, v in params.items() if k not in STORAGE_FIELDS}, storage
