"""``full``: keep everything (the full-KV reference)."""

from __future__ import annotations

from dataclasses import dataclass

from confkv.policies.base import Policy


@dataclass(frozen=True)
class FullPolicy(Policy):
    """No eviction: the reference every other policy is compared with."""

    name = "full"
