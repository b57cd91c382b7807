"""The NIAH grid's settings: protocols, :class:`NiahConfig`, and grid entries (``"confkv+int8"``).

Grid entries are policy or preset names, optionally with ``+int8`` (INT8 store, e.g.
``confkv+int8``) and ``+slack<N>`` (``evict_slack=N``, e.g. ``tiered+slack64``), each run under the same memory target: the cache holds ``memory`` of the
full cache's bytes at the end of every step (:mod:`confkv.eval.niah.budgets`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from confkv.config import StoreConfig
from confkv.errors import ConfigError

PROTOCOLS = ("query-aware", "streaming")
#: bumped when a protocol's computation changes; records of another version are not reused
PROTOCOL_VERSIONS = {"query-aware": 2, "streaming": 1}


@dataclass
class NiahConfig:
    lengths: tuple[int, ...] = (1024, 2048)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials: int = 1
    first_trial: int = 0  # trials first_trial .. first_trial + trials - 1 (split one grid over processes)
    policies: tuple[str, ...] = ("full", "streaming", "confkv")
    protocols: tuple[str, ...] = PROTOCOLS
    haystack: str = "pydoc-topics"
    needle_template: str | None = None
    question_template: str | None = None
    answer: str | None = None
    max_new_tokens: int = 10
    chunk: int = 512
    batch: int = 0
    kv_int8: bool = False
    fp_window: int = 128
    seed: int = 0
    extra_params: dict[str, Any] = field(default_factory=dict)
    share_prefill: bool = True  # query-aware: one prefill per store setting, forked per policy
    full_once: bool = True  # full KV: one computation reported under both protocols
    dtype: str = "float32"  # the model's dtype (recorded; the caller loads the model)
    #: the memory target: each cache holds this fraction of the full cache's bytes at the current
    #: length at the end of every step (so of each length's own bytes). Query-aware: the prompt is
    #: prefilled without eviction, then brought to this fraction of the prompt's bytes in one step.
    memory: float = 0.25

    def __post_init__(self) -> None:
        unknown = [p for p in self.protocols if p not in PROTOCOLS]
        if unknown:
            raise ValueError(f"unknown NIAH protocol {unknown[0]!r}; choose from {PROTOCOLS}")
        if isinstance(self.first_trial, bool) or not isinstance(self.first_trial, int) or self.first_trial < 0:
            raise ValueError(f"first_trial must be a non-negative integer, got {self.first_trial!r}")
        from confkv.tiers.storage import MemoryTarget

        MemoryTarget(memory=self.memory)  # ConfigError naming memory when outside (0, 1]
        from confkv.eval.niah.budgets import check_scoped_params, memory_params

        check_scoped_params(self.extra_params, self.policies)
        for spec in self.policies:  # a policy that cannot run under the target fails here, before any model
            memory_params(parse_spec(spec)[0], self.memory, self.extra_params)


def _suffixes(spec: str) -> list[str]:
    """The ``+``-suffixes of a grid entry, checked: ``int8`` and ``slack<N>`` (N >= 0), each at most once."""
    suffixes = spec.split("+")[1:]
    for suffix in suffixes:
        if suffix != "int8" and not (suffix.startswith("slack") and suffix[5:].isdigit()):
            raise ValueError(f"NIAH policy {spec!r}: a suffix is '+int8' (INT8 store) or '+slack<N>' (evict_slack=N), "
                             f"e.g. 'confkv+int8' or 'tiered+slack64'; got {suffix!r}")
    if len(set(suffixes)) < len(suffixes) or sum(s.startswith("slack") for s in suffixes) > 1:
        raise ValueError(f"NIAH policy {spec!r}: each suffix at most once")
    return suffixes


def parse_spec(spec: str) -> tuple[str, bool]:
    """A grid entry -> (policy name, INT8 store): ``"confkv+int8"`` -> ``("confkv", True)``; ``"tiered+slack64"``
    -> ``("tiered", False)`` (its slack: :func:`slack_of`)."""
    from confkv.policies import POLICIES
    from confkv.presets import PRESETS

    name = spec.partition("+")[0]
    suffixes = _suffixes(spec)
    if name not in POLICIES and name not in PRESETS:
        raise ConfigError(f"unknown policy {name!r} in NIAH policy {spec!r}; known: "
                          f"{', '.join(sorted(POLICIES))}; presets (with --memory): {', '.join(PRESETS)}")
    return name, "int8" in suffixes


def slack_of(spec: str) -> int:
    """The ``evict_slack`` of a grid entry: N for a ``+slack<N>`` suffix, else 0."""
    return next((int(s[5:]) for s in _suffixes(spec) if s.startswith("slack")), 0)


def _store_for(spec: str, config: NiahConfig) -> StoreConfig:
    _, int8 = parse_spec(spec)
    return StoreConfig(kv_int8=int8 or config.kv_int8, fp_window=config.fp_window, prefill_chunk=config.chunk,
                       evict_slack=slack_of(spec))

