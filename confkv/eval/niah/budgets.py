"""NIAH budgets: a fraction of full KV bytes, turned into each policy's budget parameters.

Budget: ``budget_fraction`` of the full-precision KV bytes of the longest context
(``budget_of="longest"``, the paper's setup: one memory for the whole grid; or of
``budget_tokens`` tokens, so that parts of one grid can run in several processes) or of each
length (``"each"``), converted into each policy's budget parameters by
:func:`budgets_for_bytes` (peak KV bytes; gated policies get ``n_low`` at the budget and
``n_high = ratio * n_low``).
"""

from __future__ import annotations

from typing import Any, Sequence

from confkv.config import StoreConfig
from confkv.errors import ConfigError
from confkv.eval.niah.config import NiahConfig


def budgets_for_bytes(model: Any, policies: Sequence[str], target_bytes: float, context_tokens: int, *,
                      store: StoreConfig | None = None, ratio: float = 0.5,
                      extra: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Each policy's budget parameters whose peak KV bytes (one sequence) are the largest <= ``target_bytes``.

    ``full`` gets no budget. Uses the analytic bytes model of :mod:`confkv.eval.memory_match`.
    A tiered policy with an offloaded cold tier (``offload=True``) is matched on its resident
    bytes (hot tier + digests; the page file's codes and scales are not in RAM), so a grid
    compares it with the others at equal RAM.
    """
    from confkv.eval.memory_match import BytesModel, match_budget

    bytes_model = BytesModel.for_model(model)
    out = {}
    for name in policies:
        if name == "full":
            out[name] = {}
            continue
        policy_extra = _policy_extra(name, extra)
        params, _ = match_budget(name, target_bytes, bytes_model, context_tokens, stat="peak", store=store,
                                 ratio=ratio, extra=policy_extra, resident=bool(policy_extra.get("offload")))
        out[name] = params
    return out


def _policy_extra(name: str, extra: dict[str, Any] | None) -> dict[str, Any]:
    """Extra parameters that ``name`` accepts (one ``--param`` list for several policies).

    A key ``<policy>:<parameter>`` (``confkv-r:budget=256``, as ``confkv sweep`` spells it;
    ``-`` and ``_`` alike in the policy's name) applies to that policy only and wins over the
    same unscoped key.
    """
    from confkv.policies.registry import accepted_parameters
    from confkv.presets import PRESETS, STORAGE_FIELDS

    if not extra:
        return {}
    if name in PRESETS:
        fields = accepted_parameters(PRESETS[name].policy) | set(STORAGE_FIELDS)
    else:
        fields = accepted_parameters(name)
    plain = {k: v for k, v in extra.items() if ":" not in k and k in fields}
    scoped = {}
    for key, value in extra.items():
        owner, _, field = key.partition(":")
        if field and _same_policy(owner, name):
            if field not in fields:
                raise ConfigError(f"--param {key}: {name} has no parameter {field!r}; "
                                  f"it takes {', '.join(sorted(fields))}")
            scoped[field] = value
    return {**plain, **scoped}


def _same_policy(a: str, b: str) -> bool:
    return a.replace("-", "_") == b.replace("-", "_")


def check_scoped_params(extra: dict[str, Any] | None, policies: Sequence[str]) -> None:
    """Raise :class:`ConfigError` for a ``<policy>:<parameter>`` key whose policy is not in ``policies``.

    ``policies`` are names or specs (``confkv+int8``: the part before ``+``).
    """
    names = [spec.split("+", 1)[0] for spec in policies]
    for key in extra or {}:
        owner, colon, field = key.partition(":")
        if colon and not any(_same_policy(owner, n) for n in names):
            raise ConfigError(f"--param {key}: {owner!r} is not one of the policies run ({', '.join(names)}); "
                              f"name one of them before the colon, or drop the prefix to give it to "
                              f"every policy that takes {field!r}")
        if colon:
            _policy_extra(next(n for n in names if _same_policy(owner, n)), {key: extra[key]})


def full_kv_bytes(model: Any, tokens: int, store: StoreConfig | None = None) -> float:
    """Full-precision KV bytes of one sequence of ``tokens`` tokens (all layers), as ``full`` holds them.

    A sliding-window layer (Gemma-3's local layers) holds at most ``window - 1`` past tokens
    whatever the policy, as :func:`confkv.eval.memory_match.simulate_kv_bytes` counts it.
    """
    from confkv.eval.memory_match import BytesModel

    bm = BytesModel.for_model(model)
    held = sum(tokens if w is None else min(tokens, w - 1) for w in bm.sliding_windows)
    return float(held * bm.fp_bytes)

def _reference_tokens(config: NiahConfig, length: int | None) -> int | None:
    """The context whose full KV bytes the budget is a fraction of (None: each length's own)."""
    if config.budget_tokens is not None:
        return config.budget_tokens
    if config.budget_of == "longest":
        return max(config.lengths)
    return length

