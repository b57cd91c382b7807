"""Per-sequence confidence from next-token logits (CONF-KV, METHOD.md step 1).

``c = w_H * (1 - H / log V) + w_m * M(log p1 - log p2) + w_p * p1`` divided by
``w_H + w_m + w_p``, on the model's own temperature-1 distribution, where ``M`` is
``2 * sigmoid - 1`` by default or the paper's ``sigmoid`` (see
:class:`confkv.config.ConfidenceConfig`). Sampling temperature never enters:
callers pass raw logits.
"""

from __future__ import annotations

import math
import warnings

import torch

from confkv import native
from confkv.config import ConfidenceConfig


def confidence(logits: torch.Tensor, config: ConfidenceConfig | None = None) -> torch.Tensor:
    """Confidence of each row of ``logits``.

    Args:
        logits: [B, V] raw next-token logits (any float dtype).
        config: weights; defaults to 0.4 / 0.3 / 0.3.

    Returns:
        [B] float32 in [0, 1]. Rows with NaN logits get 0 (low confidence, the safe
        side: the cache keeps more) and a ``RuntimeWarning``; ``+inf`` logits are
        treated as a one-hot choice, ``-inf`` as impossible tokens.
    """
    config = config or ConfidenceConfig()
    if logits.ndim != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    vocab = logits.shape[-1]
    terms = native.confidence_terms(logits) if vocab else None  # one C call; None: NaN / inf rows or no library
    if terms is not None:
        entropy, top1, top2 = terms.unbind(-1)
        return _combine(entropy, top1 - top2 if vocab >= 2 else torch.full_like(entropy, math.inf), top1.exp(),
                        vocab, config)
    logits = logits.float()
    nan_rows = torch.isnan(logits).any(dim=-1)
    if bool(nan_rows.any()):
        warnings.warn(f"confkv: NaN logits in {int(nan_rows.sum())} sequence(s); treating them as low confidence (c=0)",
                      RuntimeWarning, stacklevel=2)
    # +inf logits: the distribution is a point mass on those tokens.
    pos_inf = torch.isposinf(logits)
    clean = torch.where(pos_inf.any(dim=-1, keepdim=True), torch.where(pos_inf, 0.0, -math.inf), logits)
    clean = torch.where(nan_rows[:, None], torch.zeros_like(clean), clean)

    log_probs = torch.log_softmax(clean, dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))).sum(dim=-1)
    if vocab >= 2:
        top2 = log_probs.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]  # may be +inf when p2 == 0: sigmoid -> 1
    else:
        top2 = log_probs
        margin = torch.full_like(entropy, math.inf)
    p1 = top2[:, 0].exp()
    c = _combine(entropy, margin, p1, vocab, config)
    return torch.where(nan_rows, torch.zeros_like(c), c)


def _combine(entropy: torch.Tensor, margin: torch.Tensor, p1: torch.Tensor, vocab: int,
             config: ConfidenceConfig) -> torch.Tensor:
    """[B] confidence from the entropy, the margin log p1 - log p2 and p1 (each [B] float32)."""
    entropy_norm = (entropy / math.log(vocab)).clamp(0.0, 1.0) if vocab > 1 else torch.zeros_like(entropy)
    total = config.w_entropy + config.w_margin + config.w_top
    margin_term = torch.sigmoid(margin)
    if config.margin_form == "centered":
        margin_term = 2.0 * margin_term - 1.0
    c = (config.w_entropy * (1.0 - entropy_norm) + config.w_margin * margin_term + config.w_top * p1) / total
    return c.clamp(0.0, 1.0)
