"""The ``--model_args`` of ``lm_eval --model confkv``, validated (no lm_eval, no transformers here).

``model=smollm2,policy=tova,budget=1024,int8=True`` ->
:class:`BackendSettings`. Keys the backend does not know are passed to the policy;
:func:`confkv.policies.make_policy` rejects those the policy does not know either, so a
typo gets an error naming it and listing what is accepted.

Budget (KV memory, matched in bytes as ``confkv niah`` does, so an INT8 store keeps more tokens):

- ``budget=N``: the full-precision KV bytes of ``N`` tokens;
- ``kv_fraction=f``: ``f`` x the full KV bytes of the request (its prompt + ``max_gen_toks``;
  in a batch, of its longest member);
- both: the smaller; neither: the policy's own defaults (``confkv policies`` lists them), and
  the policy's own budget fields other than ``budget`` (e.g. ``n_high``/``n_low``) are taken as given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from confkv.errors import ConfigError

PROTOCOLS = ("streaming", "query-aware")
#: keys lm-eval itself passes to every backend; accepted and used where they make sense
LM_EVAL_KEYS = ("batch_size", "max_batch_size", "device")
BACKEND_KEYS = ("model", "policy", "budget", "kv_fraction", "int8", "fp_window", "chunk", "protocol",
                "query_window", "max_length", "max_gen_toks", "dtype", "ratio", "tokenizer", "pretrained",
                "trust_remote_code") + LM_EVAL_KEYS


@dataclass
class BackendSettings:
    model: str = "smollm2"
    policy: str = "confkv"
    budget: int | None = None
    kv_fraction: float | None = None
    int8: bool = False
    fp_window: int = 128
    chunk: int = 512
    protocol: str = "streaming"
    query_window: int = 64
    max_length: int | None = None
    max_gen_toks: int = 256
    dtype: str = "float32"
    ratio: float = 0.5
    batch_size: int = 1
    device: str = "cpu"
    policy_params: dict[str, Any] = field(default_factory=dict)

    @property
    def matched(self) -> bool:
        """Whether the policy's budget parameters are matched to a byte budget."""
        return self.budget is not None or self.kv_fraction is not None


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model_args {key}={value!r}: must be a positive integer")
    return value


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"model_args {key}={value!r}: must be True or False")


def parse_settings(**kwargs: Any) -> BackendSettings:
    """Validate ``--model_args`` (already split into keys by lm-eval) into :class:`BackendSettings`.

    Raises:
        ConfigError: an unknown policy, a parameter neither the backend nor the policy knows,
            or a value out of range; the message names it.
    """
    from confkv.policies import POLICIES
    from confkv.policies.registry import make_policy

    args = dict(kwargs)
    settings = BackendSettings()
    if args.get("model") is None:
        args["model"] = args.get("pretrained") or "smollm2"
    settings.model = str(args.pop("model"))
    args.pop("pretrained", None)
    args.pop("tokenizer", None)  # the model's own tokenizer is used
    args.pop("trust_remote_code", None)
    args.pop("max_batch_size", None)
    policy = str(args.pop("policy", "confkv"))
    if policy not in POLICIES:
        raise ConfigError(f"model_args policy={policy!r}: unknown policy; known policies: {', '.join(sorted(POLICIES))}")
    settings.policy = policy
    if "budget" in args:
        settings.budget = _positive_int("budget", args.pop("budget"))
    if "kv_fraction" in args:
        value = args.pop("kv_fraction")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError(f"model_args kv_fraction={value!r}: must be a number in (0, 1] (a fraction of the full KV bytes)")
        settings.kv_fraction = float(value)
    if "int8" in args:
        settings.int8 = _bool("int8", args.pop("int8"))
    for key in ("fp_window", "chunk", "query_window", "max_gen_toks"):
        if key in args:
            setattr(settings, key, _positive_int(key, args.pop(key)))
    if args.get("max_length") is not None:
        settings.max_length = _positive_int("max_length", args.pop("max_length"))
    args.pop("max_length", None)
    batch = args.pop("batch_size", 1)
    if isinstance(batch, str) and batch.startswith("auto"):
        raise ConfigError("model_args batch_size=auto: not supported by the confkv backend; give a number (e.g. 4)")
    settings.batch_size = _positive_int("batch_size", int(batch) if isinstance(batch, str) and batch.isdigit() else batch)
    if args.get("device") is not None:
        settings.device = str(args.pop("device"))
    args.pop("device", None)
    protocol = str(args.pop("protocol", "streaming"))
    if protocol not in PROTOCOLS:
        raise ConfigError(f"model_args protocol={protocol!r}: choose one of {', '.join(PROTOCOLS)}")
    settings.protocol = protocol
    dtype = str(args.pop("dtype", "float32"))
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"model_args dtype={dtype!r}: choose float32, bfloat16 or float16")
    settings.dtype = dtype
    if "ratio" in args:
        ratio = args.pop("ratio")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ConfigError(f"model_args ratio={ratio!r}: must be in (0, 1] (n_high / n_low of gated policies)")
        settings.ratio = float(ratio)
    # the rest belongs to the policy: make_policy names any key it does not know
    try:
        make_policy(policy, **dict(args))
    except ConfigError as error:
        raise ConfigError(f"model_args: {error} (backend keys: {', '.join(BACKEND_KEYS)})") from None
    settings.policy_params = args
    if policy == "full" and settings.matched:
        raise ConfigError("model_args: policy=full keeps every token; drop budget/kv_fraction or choose another policy")
    return settings


__all__ = ["BACKEND_KEYS", "BackendSettings", "PROTOCOLS", "parse_settings"]
