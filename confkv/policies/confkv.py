"""``confkv``: confidence-gated budget with EMA-attention + recency ranking (CONF-KV)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from confkv.config import GateConfig, _require
from confkv.policies.base import Policy


@dataclass(frozen=True)
class ConfKVPolicy(Policy):
    """CONF-KV (the method of this project; METHOD.md steps 1-3).

    Budget: ``gate.n_high`` tokens when the step's confidence ``c >= gate.tau``, else
    ``gate.n_low`` (per sequence).

    Ranking: per layer and KV head, every kept slot carries an exponential moving
    average of the attention mass it receives::

        ema <- ema_decay * ema + (1 - ema_decay) * mass / num_queries

    (``mass`` is averaged over the query heads of the KV group; a prefill chunk of
    ``num_queries`` queries counts as one update with the chunk's mean mass). The keep
    score adds a recency bonus that halves every ``recency_halflife`` tokens::

        score = ema + recency_weight * 2 ** (-age / recency_halflife)

    with ``age = current_position - position``. The ``protect`` most recent tokens and
    the first ``sinks`` tokens are never evicted. The bonus is read from a table of
    ``2 ** (-age / recency_halflife)`` for every age until it rounds to 0 in float32 (:func:`recency_table`), so
    that a slot's score depends on its age alone (torch's ``exp2`` may round the same value differently at
    another place of a tensor) and a C eviction computes it bit for bit (:meth:`recency_scores`).
    """

    name = "confkv"
    stat_names = ("ema",)
    needs_attention = True

    gate: GateConfig = field(default_factory=GateConfig)
    ema_decay: float = 0.9
    recency_weight: float = 0.005
    recency_halflife: float = 64.0
    protect: int = 32
    sinks: int = 4

    def __post_init__(self) -> None:
        _require(isinstance(self.gate, GateConfig), "gate", f"must be a GateConfig, got {type(self.gate).__name__}")
        _require(isinstance(self.ema_decay, (int, float)) and 0.0 <= self.ema_decay < 1.0, "ema_decay",
                 f"must be in [0, 1), got {self.ema_decay!r}")
        _require(isinstance(self.recency_weight, (int, float)) and math.isfinite(self.recency_weight)
                 and self.recency_weight >= 0, "recency_weight", f"must be a finite number >= 0, got {self.recency_weight!r}")
        _require(isinstance(self.recency_halflife, (int, float)) and math.isfinite(self.recency_halflife)
                 and self.recency_halflife > 0, "recency_halflife", f"must be > 0, got {self.recency_halflife!r}")
        super().__post_init__()

    def min_budget(self) -> int:
        return self.gate.n_high

    def max_budget(self) -> int:
        return self.gate.n_low

    def layer_budgets(self, confidence: torch.Tensor, num_layers: int) -> torch.Tensor:
        per_sequence = torch.where(confidence >= self.gate.tau, self.gate.n_high, self.gate.n_low).to(torch.int64)
        return per_sequence[:, None].expand(-1, num_layers).contiguous()

    def observe(self, stats: dict[str, torch.Tensor], mass: torch.Tensor, num_queries: int) -> None:
        ema = stats["ema"]
        ema.mul_(self.ema_decay).add_(mass, alpha=(1.0 - self.ema_decay) / max(num_queries, 1))

    def linear_observe(self, num_queries: int) -> dict[str, tuple[float, float]] | None:
        if type(self).observe is not ConfKVPolicy.observe:  # a subclass with its own update
            return None
        return {"ema": (self.ema_decay, (1.0 - self.ema_decay) / max(num_queries, 1))}

    def attention_per_read(self, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """The EMA: a running mean of the attention per query (observe divides a pass's mass by its queries)."""
        return stats["ema"]

    def scores(self, stats: dict[str, torch.Tensor], positions: torch.Tensor,
               current_position: torch.Tensor) -> torch.Tensor:
        age = (current_position[:, None, None] - positions).clamp_min(0)
        table, complete = recency_table(self.recency_halflife, positions.device)
        if complete:  # every older age's bonus is 0 too
            recency = table[age.clamp_max(table.shape[0] - 1)]
        else:  # a half-life too long for the table: ages past it computed
            recency = torch.where(age < table.shape[0], table[age.clamp_max(table.shape[0] - 1)],
                                  torch.exp2(-age.float() / self.recency_halflife))
        return stats["ema"] + self.recency_weight * recency

    def recency_scores(self, device: torch.device) -> tuple[str, float, torch.Tensor] | None:
        if type(self).scores is not _TABLE_SCORES:  # a subclass that ranks otherwise (or scores replaced on the class)
            return None
        table, complete = recency_table(self.recency_halflife, device)
        return ("ema", self.recency_weight, table) if complete else None


#: the scores the C eviction reproduces (``recency_scores``): this function itself, whatever the class holds later
_TABLE_SCORES = ConfKVPolicy.scores

#: the longest recency table (floats): a half-life of up to ~430 tokens reaches 0 within it
RECENCY_TABLE_MAX = 1 << 16
_recency_tables: dict[tuple[float, torch.device], tuple[torch.Tensor, bool]] = {}


def recency_table(halflife: float, device: torch.device) -> tuple[torch.Tensor, bool]:
    """([T] float32, complete): ``2 ** (-age / halflife)`` for ages 0 .. T - 1, as torch computes it on the CPU, up
    to the first age whose bonus rounds to 0 in float32 (its last entry; ``complete``), or :data:`RECENCY_TABLE_MAX`
    entries (the last then not 0; not ``complete``). Made once per half-life and device."""
    key = (float(halflife), device)
    made = _recency_tables.get(key)
    if made is None:
        length = min(math.ceil(152 * halflife) + 1, RECENCY_TABLE_MAX)  # 2 ** -152 rounds to 0 in float32
        table = torch.exp2(-torch.arange(length, dtype=torch.float32) / halflife)
        zeros = (table == 0).nonzero()
        if len(zeros):
            table = table[:int(zeros[0]) + 1].clone()  # its own memory: a read past its end is out of bounds
        made = _recency_tables[key] = (table.to(device).contiguous(), bool(table[-1] == 0))
    return made
