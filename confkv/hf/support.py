"""Which transformers architectures the adapter supports, and how their layers are laid out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from confkv.config import StoreConfig
from confkv.errors import UnsupportedModelError
from confkv.tiers.byte_model import KVShape
from confkv.tiers.planner import floor_bytes, floor_tokens

if TYPE_CHECKING:
    import torch

    from confkv.policies import Policy

#: model_type -> human name. Each was checked with a tiny random model (tests/hf/test_exactness.py).
SUPPORTED_MODEL_TYPES = {
    "llama": "Llama / SmolLM2",
    "qwen2": "Qwen2",
    "mistral": "Mistral",
    "gpt2": "GPT-2",
    "gemma3_text": "Gemma-3 (text)",
}


@dataclass(frozen=True)
class LayerLayout:
    """Per decoder layer: ``None`` for global attention, or the sliding window size."""

    sliding_windows: tuple[int | None, ...]

    @property
    def num_layers(self) -> int:
        return len(self.sliding_windows)

    @property
    def managed(self) -> list[int]:
        """Indices of the global-attention layers, the ones the policy evicts."""
        return [i for i, w in enumerate(self.sliding_windows) if w is None]


def text_config(config):
    """The decoder config of ``config`` (the text part of a multimodal Gemma-3 config)."""
    if getattr(config, "model_type", None) == "gemma3" and hasattr(config, "text_config"):
        return config.text_config
    return config


def check_supported(config) -> None:
    """Raise :class:`UnsupportedModelError` unless the model's architecture is supported."""
    model_type = getattr(text_config(config), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        names = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_MODEL_TYPES.items())
        raise UnsupportedModelError(
            f"confkv does not support model_type={model_type!r}; supported architectures: {names}. "
            "Other decoder-only models may work but were not checked; open an issue with the model id.")


def layer_layout(config) -> LayerLayout:
    """Global vs sliding-window layers of a supported model."""
    check_supported(config)
    config = text_config(config)
    num_layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer")
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is None:
        use_sliding = window is not None and getattr(config, "use_sliding_window", True)
        layer_types = ["sliding_attention" if use_sliding else "full_attention"] * num_layers
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types[:num_layers])
    return LayerLayout(windows)


def kv_shape(model) -> KVShape:
    """What the byte formulas need to know about ``model`` (:class:`~confkv.tiers.byte_model.KVShape`): its KV
    heads, head size, element size and each layer's sliding window."""
    config = text_config(model.config)
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    element_size = next(model.parameters()).element_size()
    return KVShape(kv_heads, head_dim, element_size, tuple(layer_layout(model.config).sliding_windows))


def floor_bytes_of(model: torch.nn.Module, layout: LayerLayout, policy: Policy, store: StoreConfig | None = None,
                   batch: int = 1) -> int:
    """The smallest bytes ``model``'s cache can hold under ``policy`` (:func:`confkv.tiers.planner.floor_bytes`),
    for ``batch`` sequences; ``store`` a :class:`~confkv.config.StoreConfig` (default one)."""
    store = store or StoreConfig()
    return floor_bytes(kv_shape(model), layout, floor_tokens(policy, store), store, batch)
