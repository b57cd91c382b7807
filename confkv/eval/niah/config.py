"""The NIAH grid's settings: protocols, :class:`NiahConfig`, and grid entries (``"confkv+int8"``).

Grid entries are policy names, optionally with ``+int8`` (INT8 store, e.g.
``confkv+int8``), each matched to the same KV bytes (:mod:`confkv.eval.niah.budgets`).
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
    budget_fraction: float = 0.25
    budget_of: str = "longest"
    max_new_tokens: int = 10
    chunk: int = 512
    batch: int = 0
    kv_int8: bool = False
    fp_window: int = 128
    ratio: float = 0.5
    seed: int = 0
    extra_params: dict[str, Any] = field(default_factory=dict)
    share_prefill: bool = True  # query-aware: one prefill per store setting, forked per policy
    full_once: bool = True  # full KV: one computation reported under both protocols
    dtype: str = "float32"  # the model's dtype (recorded; the caller loads the model)
    budget_tokens: int | None = None  # budget = fraction of this many tokens' KV (overrides budget_of)
    #: a memory target (fraction of the full cache's bytes at the current length, held by the cache at
    #: every step: so of each length's own bytes); replaces the offline budget matching (streaming protocol)
    memory: float | None = None

    def __post_init__(self) -> None:
        unknown = [p for p in self.protocols if p not in PROTOCOLS]
        if unknown:
            raise ValueError(f"unknown NIAH protocol {unknown[0]!r}; choose from {PROTOCOLS}")
        if self.budget_of not in ("longest", "each"):
            raise ValueError("budget_of must be 'longest' or 'each'")
        if self.budget_tokens is not None and (isinstance(self.budget_tokens, bool) or self.budget_tokens < 1):
            raise ValueError(f"budget_tokens must be a positive number of tokens, got {self.budget_tokens!r}")
        if isinstance(self.first_trial, bool) or not isinstance(self.first_trial, int) or self.first_trial < 0:
            raise ValueError(f"first_trial must be a non-negative integer, got {self.first_trial!r}")
        if not 0 < self.budget_fraction <= 1:
            raise ValueError("budget_fraction must be in (0, 1]")
        if self.memory is not None:
            from confkv.tiers.storage import MemoryTarget

            MemoryTarget(memory=self.memory)  # ConfigError naming memory when outside (0, 1]
            if "query-aware" in self.protocols:
                raise ValueError("memory: a memory target runs the streaming protocol only; give --protocols streaming")
        from confkv.eval.niah.budgets import check_scoped_params

        check_scoped_params(self.extra_params, self.policies)


def parse_spec(spec: str) -> tuple[str, bool]:
    """A grid entry -> (policy name, INT8 store): ``"confkv+int8"`` -> ``("confkv", True)``."""
    from confkv.policies import POLICIES
    from confkv.presets import PRESETS

    name, plus, suffix = spec.partition("+")
    if plus and suffix != "int8":
        raise ValueError(f"NIAH policy {spec!r}: the only suffix is '+int8' (INT8 store), e.g. 'confkv+int8'")
    if name not in POLICIES and name not in PRESETS:
        raise ConfigError(f"unknown policy {name!r} in NIAH policy {spec!r}; known: "
                          f"{', '.join(sorted(POLICIES))}; presets (with --memory): {', '.join(PRESETS)}")
    return name, bool(plus)


def _store_for(spec: str, config: NiahConfig) -> StoreConfig:
    _, int8 = parse_spec(spec)
    return StoreConfig(kv_int8=int8 or config.kv_int8, fp_window=config.fp_window, prefill_chunk=config.chunk)

