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

from confkv.errors import ConfigError
from confkv.tiers.storage import MemoryTarget, Storage

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
        policy="confkv-fixed", storage=Storage(ladder=(8, 4, 3), hot_share=0.2, page_size=64, group_size=64,
                                               step_down_by="heat", format="kivi+hadamard"),
        summary="CONF-KV's EMA ranking for a full-precision hot tier; every other token on an 8/4/3-bit ladder "
                "(a 2-bit bottom rung cost +85% perplexity at 12.5% on the tuning text, 3-bit +28%), its pages "
                "rotated by a Hadamard transform per KV head before quantizing (no byte; the 3-bit pages keep "
                "what they say: 8K needles 19 of 25 against 14 with plain KIVI pages; results/memory/README.md)"),
    "tiered-int8": Preset(
        policy="confkv-fixed", storage=Storage(ladder=(8, 4, 3), hot_share=0.2, page_size=64, group_size=64,
                                               step_down_by="heat", format="kivi+hadamard", hot_int8_window=8,
                                               open_bits=8),
        summary="the quality setting: the tiered preset with its hot tier in INT8 past its 8 newest tokens, once the "
                "cache is over its target (exact below it), and the ladder's open page in INT8 per token "
                "(SmolLM2, 2K, per-step targets: perplexity +2.5% at 25% and +13.6% at 12.5% on the tuning text "
                "against the default's +7.6% / +22.6%; results/memory/README.md, 'The open page in INT8')"),
    "kivi-4": Preset(
        policy="window", storage=Storage(ladder=(4,), hot_tokens=128, page_size=64, group_size=64, step_down_by="age"),
        summary="KIVI under a target: 128 recent tokens in full precision, older ones 4-bit, the oldest dropped"),
    "kivi-2": Preset(
        policy="window", storage=Storage(ladder=(2,), hot_tokens=128, page_size=64, group_size=64, step_down_by="age"),
        summary="KIVI under a target: 128 recent tokens in full precision, older ones 2-bit, the oldest dropped"),
}
DEFAULT_PRESET = "tiered"

STORAGE_FIELDS = tuple(f.name for f in dataclasses.fields(Storage))


#: storage fields added after results were keyed by :func:`preset_signature`, each with the value that behaves as
#: the storage did before it existed: left out of the signature at that value, so those results still resume
STORAGE_FIELDS_ADDED_LATER = {"unread_by": "age", "hot_split": "share", "seal_before_drop": False,
                              "hot_int8_window": None, "hot_slack": 0.0, "open_bits": 16,
                              "ladder_slack": 0.0, "rotation_seed": 0}


def preset_signature(name: str) -> str | None:
    """The preset ``name``'s ranking policy, parameters and storage as one string (None for a name that
    is not a preset). Results keyed by it are not resumed under a preset whose defaults changed."""
    preset = PRESETS.get(name)
    if preset is None:
        return None
    storage = ", ".join(f"{f.name}={getattr(preset.storage, f.name)!r}" for f in dataclasses.fields(preset.storage)
                        if STORAGE_FIELDS_ADDED_LATER.get(f.name, object()) != getattr(preset.storage, f.name))
    return f"{preset.policy} {sorted(preset.params.items())} Storage({storage})"


def split_storage_params(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``params`` -> (policy parameters, :class:`Storage` fields)."""
    storage = {k: tuple(v) if k == "ladder" and isinstance(v, list) else v  # a ladder from JSON is a list
               for k, v in params.items() if k in STORAGE_FIELDS}
    return {k: v for k, v in params.items() if k not in STORAGE_FIELDS}, storage


@dataclass(frozen=True)
class CacheSpec:
    """What a cache is made of (ARCHITECTURE.md): the ranking policy, the storage and the memory target."""

    policy: Any  # confkv.policies.Policy
    storage: Storage | None
    target: MemoryTarget | None


def resolve(policy: Any = None, *, memory: float | None = None, max_kv_bytes: int | None = None,
            storage: Storage | None = None, **params: Any) -> CacheSpec:
    """The policy, storage and target that ``ConfKVCache.for_model(model, policy, memory=..., ...)`` builds.

    - no policy: :data:`DEFAULT_PRESET`; a preset with no target: :data:`DEFAULT_MEMORY`;
    - a preset name: its ranking policy and storage; :class:`Storage` field names among ``params``
      override the preset's storage, the rest are the policy's parameters;
    - a registry name or a Policy object: that policy; with a target it only ranks, and ``storage``
      (default: none, evicted tokens are dropped) holds the tokens; without a target its own budgets run.

    Raises:
        ConfigError: a bad value, named by its field (the memory, the storage, the policy's parameters).
    """
    from confkv.policies import make_policy  # noqa: PLC0415

    if policy is None:
        policy = DEFAULT_PRESET
    if isinstance(policy, str) and policy in PRESETS:
        preset = PRESETS[policy]
        params, storage_params = split_storage_params(params)
        if storage is not None and storage_params:
            raise ConfigError(f"{next(iter(storage_params))}: give storage fields either in storage= or as "
                              "parameters of the preset, not both")
        storage = storage or dataclasses.replace(preset.storage, **storage_params)
        policy, params = preset.policy, {**preset.params, **params}
        if memory is None and max_kv_bytes is None:
            memory = DEFAULT_MEMORY
    target = None if memory is None and max_kv_bytes is None else MemoryTarget(memory, max_kv_bytes)
    built = make_policy(policy, **params)
    if storage is not None and target is None:
        raise ConfigError("storage: a storage holds a memory target; give memory= (a fraction of the full "
                          "cache's bytes) or max_kv_bytes= with it")
    if target is not None and storage is None:
        storage = Storage(ladder=())
    if target is not None:
        from confkv.policies.tiered import TieredPolicy  # noqa: PLC0415

        if isinstance(built, TieredPolicy):
            raise ConfigError(f"storage: policy {built.name!r} brings its own cold tier (policy.cold); under a "
                              "memory target give a ranking policy (e.g. 'tova', 'h2o', 'confkv-fixed'), or a preset "
                              f"({', '.join(PRESETS)})")
    return CacheSpec(built, storage, target)
