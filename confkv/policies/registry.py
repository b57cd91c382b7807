"""One registry of policies by name: it feeds the API, the CLI and the test matrix."""

from __future__ import annotations

import dataclasses
from typing import Any

from confkv.config import ColdConfig, GateConfig, ConfidenceConfig
from confkv.errors import ConfigError
from confkv.policies.base import Policy
from confkv.policies.confkv import ConfKVPolicy
from confkv.policies.confkv_fixed import ConfKVFixedPolicy
from confkv.policies.confkv_l import ConfKVLPolicy
from confkv.policies.full import FullPolicy
from confkv.policies.confkv_r import ConfKVRPolicy
from confkv.policies.h2o import H2OPolicy
from confkv.policies.kivi import KIVIPolicy
from confkv.policies.quest import QuestPolicy
from confkv.policies.random_evict import RandomPolicy
from confkv.policies.scissorhands import ScissorhandsPolicy
from confkv.policies.snapkv import SnapKVPolicy
from confkv.policies.streaming import StreamingPolicy
from confkv.policies.tova import TOVAPolicy
from confkv.policies.window import WindowPolicy

POLICIES: dict[str, type[Policy]] = {}


def register(policy_class: type[Policy]) -> type[Policy]:
    """Register ``policy_class`` under its ``name`` (usable as a decorator)."""
    POLICIES[policy_class.name] = policy_class
    return policy_class


for _cls in (FullPolicy, WindowPolicy, StreamingPolicy, ConfKVPolicy,
             H2OPolicy, ScissorhandsPolicy, TOVAPolicy, RandomPolicy, ConfKVFixedPolicy, ConfKVLPolicy,
             ConfKVRPolicy, QuestPolicy, KIVIPolicy, SnapKVPolicy):
    register(_cls)

_GATE_FIELDS = ("tau", "n_high", "n_low", "smoothing")
_CONFIDENCE_FIELDS = ("w_entropy", "w_margin", "w_top", "margin_form")
_COLD_FIELDS = tuple(f.name for f in dataclasses.fields(ColdConfig))


def policy_parameters(name: str) -> dict[str, Any]:
    """The flat parameters ``make_policy(name, ...)`` accepts, with their defaults."""
    policy_class = POLICIES[name]
    params: dict[str, Any] = {}
    for f in dataclasses.fields(policy_class):
        if f.name == "gate":
            gate = GateConfig()
            params.update({k: getattr(gate, k) for k in _GATE_FIELDS})
            params.update({k: getattr(gate.confidence, k) for k in _CONFIDENCE_FIELDS})
        elif f.name == "cold":
            params.update(dataclasses.asdict(f.default_factory()))  # type: ignore[misc]
        elif f.default is not dataclasses.MISSING:
            params[f.name] = f.default
    return params


def accepted_parameters(name: str) -> set[str]:
    """Every flat parameter name ``make_policy(name, ...)`` accepts (gate, confidence and cold fields folded in)."""
    fields = {f.name for f in dataclasses.fields(POLICIES[name])}
    if "gate" in fields:
        fields |= set(_GATE_FIELDS) | set(_CONFIDENCE_FIELDS)
    if "cold" in fields:
        fields |= set(_COLD_FIELDS) | {"k"}
    return fields


def make_policy(name: str | Policy, **params: Any) -> Policy:
    """Build a policy from its name and flat parameters.

    Gate parameters (``tau``, ``n_high``, ``n_low``) and confidence weights
    (``w_entropy``, ``w_margin``, ``w_top``, ``margin_form``) may be given flat; they are
    folded into the policy's ``gate`` field. Cold-tier settings of tiered policies (``bits``,
    ``page_size``, ``group_size``, ``k_high``, ``k_low``, ``cold_budget``, ``offload``,
    ``offload_dir``, ``promote``, ``format``, ``outlier_fraction``, ``value_bits``, ``open_bits``,
    ``rotation_seed``; ``k`` sets ``k_high = k_low``) are folded into its ``cold`` field. Unknown names or
    parameters raise :class:`ConfigError` listing what is known.
    """
    if isinstance(name, Policy):
        if params:
            raise ConfigError("policy: pass either a Policy object or a name with parameters, not both")
        return name
    if name not in POLICIES:
        raise ConfigError(f"policy: unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}")
    policy_class = POLICIES[name]
    fields = {f.name for f in dataclasses.fields(policy_class)}  # ClassVars (name, stat_names, ...) excluded
    if "gate" in fields:
        gate_params = {k: params.pop(k) for k in _GATE_FIELDS if k in params}
        conf_params = {k: params.pop(k) for k in _CONFIDENCE_FIELDS if k in params}
        if gate_params or conf_params:
            base_gate = params.pop("gate", GateConfig())
            base_conf = base_gate.confidence
            confidence = ConfidenceConfig(**{**base_conf.__dict__, **conf_params})
            params["gate"] = GateConfig(**{**{k: getattr(base_gate, k) for k in _GATE_FIELDS}, **gate_params},
                                        confidence=confidence)
    if "cold" in fields:
        if "k" in params:  # one fixed read budget: k_high = k_low = k
            params["k_high"] = params["k_low"] = params.pop("k")
        cold_params = {k: params.pop(k) for k in _COLD_FIELDS if k in params}
        if cold_params:
            base_cold = params.pop("cold", None) or next(f for f in dataclasses.fields(policy_class)
                                                         if f.name == "cold").default_factory()  # type: ignore[misc]
            params["cold"] = ColdConfig(**{**dataclasses.asdict(base_cold), **cold_params})
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a parameter of policy {name!r}; "
                          f"its parameters are: {', '.join(sorted(policy_parameters(name)))}")
    return policy_class(**params)
