"""``kivi``: the whole cache in 2/3/4 bits plus a full-precision recent window (the quantization anchor)."""

from __future__ import annotations

from dataclasses import dataclass, field

from confkv.config import ALL_PAGES, ColdConfig
from confkv.policies.tiered import TieredPolicy
from confkv.policies.window import WindowPolicy


@dataclass(frozen=True)
class KIVIPolicy(TieredPolicy, WindowPolicy):
    """KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"):
    no eviction; the ``budget`` most recent tokens stay in the model's precision (KIVI's
    residual, R = 128) and every older token is stored in ``cold.bits`` bits (keys per channel
    in groups of ``cold.group_size`` tokens, values per token in groups of ``group_size``
    channels, G = 32) and read at every step (``k_high = k_low =`` all pages).
    """

    name = "kivi"
    budget: int = 128
    protect: int = 0  # WindowPolicy's default (restated: TieredPolicy brings the base one)
    cold: ColdConfig = field(default_factory=lambda: ColdConfig(bits=4, page_size=32, group_size=32,
                                                               k_high=ALL_PAGES, k_low=ALL_PAGES))
