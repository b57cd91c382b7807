"""confkv: confidence-gated KV-cache eviction (CONF-KV) for long LLM decoding.

The core (config, confidence, policies, store, attention read) is plain PyTorch and
imports nothing from transformers; :mod:`confkv.hf` is the transformers adapter.
"""

from confkv import _moved
from confkv.config import ConfidenceConfig, GateConfig, StoreConfig
from confkv.confidence import confidence
from confkv.errors import ConfigError, ConfKVError, PromptTooLongError, UnsupportedModelError
from confkv.policies import POLICIES, Policy, make_policy

__version__ = "0.1.0"
_moved.install()  # old import paths of moved modules, for one release

__all__ = ["POLICIES", "ConfKVError", "ConfidenceConfig", "ConfigError", "GateConfig", "Policy",
           "PromptTooLongError", "StoreConfig", "UnsupportedModelError", "confidence", "make_policy"]
