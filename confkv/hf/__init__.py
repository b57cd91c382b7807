"""The transformers adapter: a ``Cache`` subclass, the ``"confkv"`` attention function, generate glue."""

from confkv.hf.cache import ConfKVCache, ConfKVLayer
from confkv.hf.enable import disable, enable, enabled
from confkv.hf.generate import check_prompt_length, generate, prefill
from confkv.hf.support import SUPPORTED_MODEL_TYPES, check_supported

__all__ = ["SUPPORTED_MODEL_TYPES", "ConfKVCache", "ConfKVLayer", "check_prompt_length", "check_supported",
           "disable", "enable", "enabled", "generate", "prefill"]
