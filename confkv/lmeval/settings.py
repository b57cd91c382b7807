"""The ``--model_args`` of ``lm_eval --model confkv``, validated (no lm_eval, no transformers here).

``model=smollm2,policy=tova,memory=0.25,int8=True`` ->
:class:`BackendSettings`. Keys the backend does not know are passed to the policy;
:func:`confkv.presets.resolve` rejects those the policy does not know either, so a
typo gets an error naming it and listing what is accepted.

Memory (as every confkv grid sets it: the cache holds the target itself, nothing is matched):

- ``memory=f``: the cache holds ``f`` of the full cache's bytes at the end of every step (of
  the length fed so far; ``protocol=query-aware``: the prompt is prefilled without eviction,
  then brought to ``f`` of its bytes in one step, as kvpress's compression ratio ``1 - f``);
- ``max_kv_bytes=N``: an absolute cap in bytes instead;
- neither: the policy's own budgets (``budget=N`` for most policies, ``n_high``/``n_low`` for
  the gated ones; ``confkv policies`` lists them), or a preset (``policy=tiered``) at 0.25.

The policy may be a preset (``tiered``, ``tiered-int8``, ``kivi-4``, ``kivi-2``); its storage fields
(``ladder``, ``hot_share``, ...) are accepted as parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from confkv.errors import ConfigError

PROTOCOLS = ("streaming", "query-aware")
#: keys lm-eval itself passes to every backend; accepted and used where they make sense
LM_EVAL_KEYS = ("batch_size", "max_batch_size", "device")
BACKEND_KEYS = ("model", "policy", "memory", "max_kv_bytes", "int8", "fp_window", "chunk", "protocol",
                "query_window", "max_length", "max_gen_toks", "dtype", "tokenizer", "pretrained",
                "trust_remote_code") + LM_EVAL_KEYS


@dataclass
class BackendSettings:
    model: str = "smollm2"
    policy: str = "confkv"
    memory: float | None = None
    max_kv_bytes: int | None = None
    int8: bool = False
    fp_window: int = 128
    chunk: int = 512
    protocol: str = "streaming"
    query_window: int = 64
    max_length: int | None = None
    max_gen_toks: int = 256
    dtype: str = "float32"
    batch_size: int = 1
    device: str = "cpu"
    policy_params: dict[str, Any] = field(default_factory=dict)

    @property
    def targeted(self) -> bool:
        """Whether the cache holds a memory target (``memory`` or ``max_kv_bytes``)."""
        return self.memory is not None or self.max_kv_bytes is not None

    def cache_params(self) -> dict[str, Any]:
        """The parameters of ``ConfKVCache.for_model``: the policy's, and the memory target if any."""
        target = {k: v for k, v in (("memory", self.memory), ("max_kv_bytes", self.max_kv_bytes)) if v is not None}
        return {**self.policy_params, **target}


#: model_args removed with the offline budget matching -> what to give instead
REMOVED_KEYS = {
    "kv_fraction": "give memory=F instead: the cache holds F of the full cache's bytes at every step "
                   "(kv_fraction=0.25 is memory=0.25)",
    "ratio": "under memory=F the hot budget comes from the target; give a gated policy's n_high / n_low if you "
             "want them without a target",
}


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
    from confkv.presets import PRESETS, resolve

    args = dict(kwargs)
    settings = BackendSettings()
    if args.get("model") is None:
        args["model"] = args.get("pretrained") or "smollm2"
    settings.model = str(args.pop("model"))
    args.pop("pretrained", None)
    args.pop("tokenizer", None)  # the model's own tokenizer is used
    args.pop("trust_remote_code", None)
    args.pop("max_batch_size", None)
    for key, instead in REMOVED_KEYS.items():
        if key in args:
            raise ConfigError(f"model_args {key}={args[key]!r}: removed with the offline budget matching; {instead}")
    policy = str(args.pop("policy", "confkv"))
    if policy not in POLICIES and policy not in PRESETS:
        raise ConfigError(f"model_args policy={policy!r}: unknown policy; known policies: {', '.join(sorted(POLICIES))}; "
                          f"presets: {', '.join(PRESETS)}")
    settings.policy = policy
    if "memory" in args:
        value = args.pop("memory")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError(f"model_args memory={value!r}: must be a number in (0, 1] (a fraction of the full "
                              "cache's bytes, e.g. memory=0.25)")
        settings.memory = float(value)
    if "max_kv_bytes" in args:
        settings.max_kv_bytes = _positive_int("max_kv_bytes", args.pop("max_kv_bytes"))
    if settings.memory is not None and settings.max_kv_bytes is not None:
        raise ConfigError("model_args memory= and max_kv_bytes=: give one of them (a fraction or a cap)")
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
    if policy == "full" and settings.targeted:
        raise ConfigError("model_args: policy=full keeps every token; drop memory/max_kv_bytes or choose another policy")
    # the rest belongs to the policy (or the preset's storage): resolve names any key it does not know
    settings.policy_params = args
    try:
        resolve(policy, **settings.cache_params())
    except ConfigError as error:
        raise ConfigError(f"model_args: {error} (backend keys: {', '.join(BACKEND_KEYS)})") from None
    return settings


__all__ = ["BACKEND_KEYS", "BackendSettings", "PROTOCOLS", "REMOVED_KEYS", "parse_settings"]
