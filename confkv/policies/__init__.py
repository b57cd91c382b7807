"""Eviction policies, one per file, all reachable by name through :func:`make_policy`."""

from confkv.policies.base import UNLIMITED, Policy
from confkv.policies.registry import POLICIES, make_policy, register

__all__ = ["POLICIES", "UNLIMITED", "Policy", "make_policy", "register"]
