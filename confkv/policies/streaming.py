"""``streaming``: StreamingLLM, attention-sink tokens plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

from confkv.policies.window import WindowPolicy


@dataclass(frozen=True)
class StreamingPolicy(WindowPolicy):
    """StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention
    Sinks"): keep the first ``sinks`` tokens (4 by default) and the ``budget - sinks``
    most recent ones."""

    name = "streaming"
    sinks: int = 4
