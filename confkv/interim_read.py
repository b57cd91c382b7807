"""Temporary dense attention read (replaced by confkv.attention.blockwise)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVSegment:
    keys: torch.Tensor
    values: torch.Tensor
    visible: torch.Tensor | None
    key_token_scale: torch.Tensor | None = None
    key_channel_scale: torch.Tensor | None = None
    value_token_scale: torch.Tensor | None = None


def blockwise_attention(query, segments, scaling, block_size=256, softcap=None, need_mass=True):
    batch, hq, q, d = query.shape
    hkv = segments[0].keys.shape[1]
    group = hq // hkv
    keys = torch.cat([s.keys.float() for s in segments], dim=2)
    values = torch.cat([s.values.float() for s in segments], dim=2)
    vis = torch.cat([(s.visible if s.visible is not None else torch.ones(1, 1, 1, 1, dtype=torch.bool)).expand(batch, hkv, q, s.keys.shape[2]) for s in segments], dim=-1)
    qg = query.float().reshape(batch, hkv, group * q, d)
    scores = qg @ keys.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    vis_g = vis[:, :, None].expand(batch, hkv, group, q, vis.shape[-1]).reshape(batch, hkv, group * q, -1)
    scores = scores.masked_fill(~vis_g, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = (probs @ values).reshape(batch, hq, q, d).to(query.dtype)
    masses = None
    if need_mass:
        total = probs.reshape(batch, hkv, group, q, -1).mean(2).sum(2)
        masses = list(total.split([s.keys.shape[2] for s in segments], dim=-1))
    return out, masses
