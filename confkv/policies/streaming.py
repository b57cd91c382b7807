"""``streaming``: StreamingLLM, attention-sink tokens plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

from confkv.policies.window import WindowPolicy


@dataclass(frozen=True)
class StreamingPolicy(WindowPolicy):
    """StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention
    Sinks"): keep the first ``sinks`` tokens (4 by default) and the ``budget - sinks``
    most recent ones, at the end of each step (docs/USAGE.md, "What a budget counts"): StreamingLLM's
    ``start_size + recent_size`` in its perplexity loop, which cuts the cache after each forward pass."""

    name = "streaming"
    sinks: int = 4
