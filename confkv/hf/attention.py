"""The ``"confkv"`` attention implementation registered with transformers.

``ConfKVLayer.update`` returns the keys with its :class:`~confkv.store.LayerStore` attached
(:func:`keys_for_attention`); the model passes them to :func:`confkv_attention`, which reads over the
store (INT8 region, FP window and the new tokens) and records the queries' attention
mass for the policy. No eager attention, no [B, H, q, L] weights returned to the model.

transformers builds no 4D mask for this implementation: the registered mask function
only passes the 2D padding mask through, and the store applies causality, padding and
sliding windows itself from the positions it tracks. Without a confkv cache (a plain
forward, or another cache), the function falls back to PyTorch SDPA with a causal and
padding mask, so a model switched to ``"confkv"`` still runs everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from confkv.store import LayerStore

ATTENTION_NAME = "confkv"
_STORE_ATTRIBUTE = "confkv_store"


def keys_for_attention(store: LayerStore) -> torch.Tensor:
    """The keys ``ConfKVLayer.update`` returns: a fresh view of the store's new keys [B, Hkv, q, D] that carries
    ``store``, so the attention call that receives them reads over it (no state outside the call)."""
    keys = store.recent.keys
    keys = keys.view(keys.shape)
    setattr(keys, _STORE_ATTRIBUTE, store)
    return keys


def confkv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None, **kwargs
                     ) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query [B, Hq, q, D], key/value [B, Hkv, L, D] -> ([B, q, Hq, D], None)."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    padding = attention_mask if attention_mask is not None and attention_mask.ndim == 2 else None
    store = getattr(key, _STORE_ATTRIBUTE, None)
    if store is not None:
        out = store.attend(query, scaling=scaling, padding=padding, softcap=softcap)
    else:
        out = _sdpa_fallback(query, key, value, padding, scaling, sliding_window, softcap)
    return out.transpose(1, 2).contiguous(), None


def _sdpa_fallback(query, key, value, padding, scaling, sliding_window, softcap):
    """Causal attention without a confkv store: new queries sit at the end of ``key``."""
    q_len, kv_len = query.shape[2], key.shape[2]
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
    k_pos = torch.arange(kv_len, device=query.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < sliding_window)
    mask = mask[None, None]
    if padding is not None:
        mask = mask & padding[:, -kv_len:].bool()[:, None, None, :]
    group = query.shape[1] // key.shape[1]
    if softcap is not None:
        key_r, value_r = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        scores = (query @ key_r.transpose(-1, -2)) * scaling
        scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        return probs.to(value_r.dtype) @ value_r
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=group > 1)
    return out.nan_to_num(0.0)


def padding_passthrough_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                             mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs
                             ) -> torch.Tensor | None:
    """Mask function for ``"confkv"``: the 2D padding mask [B, <= kv_length] bool, or None if nothing is padded."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].bool()
    return None if bool(attention_mask.all()) else attention_mask


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, confkv_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, padding_passthrough_mask)
