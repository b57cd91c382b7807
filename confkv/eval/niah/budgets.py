"""The grids' cache parameters: ``--param`` values per policy, and the memory target.

Every grid (``confkv sweep``, ``niah``, ``ruler``, ``agent``, the lm-eval backend) sets memory the
same way: ``memory=F``, the cache itself holding ``F`` of the full cache's bytes at the end of
every step (:meth:`confkv.hf.ConfKVCache.for_model`, :mod:`confkv.tiers.planner`). Nothing is
matched or predicted before a run; :func:`memory_params` only checks that a policy (or preset)
can run under the target.
"""

from __future__ import annotations

from typing import Any, Sequence

from confkv.errors import ConfigError


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


def full_kv_bytes(model: Any, tokens: int) -> float:
    """Bytes the full cache holds for one sequence of ``tokens`` tokens (all layers, the model's dtype):
    the reference of a ``--memory`` fraction (:func:`confkv.tiers.byte_model.full_cache_bytes`; a
    sliding-window layer holds at most ``window - 1`` past tokens)."""
    from confkv.hf.support import kv_shape
    from confkv.tiers.byte_model import full_cache_bytes

    return float(full_cache_bytes(kv_shape(model), tokens))


def memory_params(name: str, memory: float, extra: dict[str, Any] | None) -> dict[str, Any]:
    """A grid entry's cache parameters under a memory target: the ``--param`` values ``name`` takes
    (:func:`_policy_extra`) and ``memory``; ``full`` gets none (it holds every token).

    Raises:
        ConfigError: the policy (or preset) cannot run under the target, named by the field at fault
            (e.g. a policy with its own cold tier; a bad storage field such as ``tiered:ladder=[8,5]``).
    """
    if name == "full":
        return {}
    from confkv.presets import resolve

    params = {**_policy_extra(name, extra), "memory": memory}
    try:
        resolve(name, **params)
    except ConfigError as error:
        raise ConfigError(f"{name} at memory {memory:g}: {error}") from None
    return params
