"""Several policies observing one shared forward pass (one prefill, many policies).

A query-aware comparison (SnapKV-style: prefill the whole prompt without evicting, then
compress once) runs the *same* forward pass for every full-precision policy: nothing is
evicted during the prefill, so the keys, values and attention are identical and only the
policies' statistics differ. :class:`TeePolicy` lets one prefill feed every member's
statistics at once (each under its own stat names, ``"<index>.<name>"``); afterwards
:meth:`confkv.store.LayerStore.fork` gives each member its own copy of the store with its
statistics under their usual names, exactly as if it had run the prefill alone (tested
against separate runs in ``tests/hf/test_tee_fork.py``).

The tee itself never evicts (its budget is unlimited).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from confkv.policies.base import Policy


@dataclass(frozen=True)
class TeePolicy(Policy):
    """Feed every member's per-slot statistics from one forward pass; evict nothing.

    Attributes:
        members: the policies to observe for; their ``protect`` / ``sinks`` matter only
            once a store is forked for one of them.
    """

    name = "tee"
    members: tuple[Policy, ...] = ()

    @classmethod
    def of(cls, members: Sequence[Policy]) -> TeePolicy:
        """A tee over ``members``; its FP window is the widest member protection, so a fork
        never holds fewer recent slots than its member would have (the store ages at once)."""
        members = tuple(members)
        return cls(protect=max((m.protect for m in members), default=0), members=members)

    def __post_init__(self) -> None:
        if not self.members or not all(isinstance(m, Policy) for m in self.members):
            raise ValueError("TeePolicy needs a non-empty tuple of Policy members")
        super().__post_init__()

    @property
    def stat_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self.member_stat_name(i, n) for i, m in enumerate(self.members) for n in m.stat_names)

    @property
    def needs_attention(self) -> bool:  # type: ignore[override]
        return any(m.needs_attention for m in self.members)

    @staticmethod
    def member_stat_name(index: int, name: str) -> str:
        return f"{index}.{name}"

    def member_stats(self, index: int, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Member ``index``'s view of ``stats`` (same tensors, its own names)."""
        return {name: stats[self.member_stat_name(index, name)] for name in self.members[index].stat_names}

    def observe(self, stats: dict[str, torch.Tensor], mass: torch.Tensor, num_queries: int) -> None:
        for index, member in enumerate(self.members):
            if member.stat_names:
                member.observe(self.member_stats(index, stats), mass, num_queries)
