"""The machine under ``confkv bench``: copy bandwidth, weight bytes read per step, RSS, load average.

These give each configuration's memory-bandwidth floor and say how loaded the machine was.
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import torch


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_bandwidth(mib: int = 512, repeats: int = 5) -> dict[str, float]:
    """Copy bandwidth (read + write bytes per second) of a ``mib`` MiB float32 tensor, median of repeats."""
    src = torch.ones(mib * (1 << 20) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        rates.append(2 * src.nbytes / (time.perf_counter() - start))
    return {"median_gbps": statistics.median(rates) / 1e9, "max_gbps": max(rates) / 1e9,
            "min_gbps": min(rates) / 1e9, "mib": mib}


def weight_bytes_read(model: Any) -> int:
    """Bytes of parameters read per decode step: every unique parameter and buffer but the
    embedding table (only one row of it is read; when it is tied to the LM head the head reads
    it all). Weight-only INT8 layers (:class:`confkv.hf.weights.Int8Linear`) count their int8
    weights and scales, which are buffers; the rotary tables are buffers too (a few KB)."""
    seen: set[int] = set()
    total = 0
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_weight = getattr(head, "weight", None)
    tied = head_weight is not None and head_weight.data_ptr() == embed.data_ptr()
    for p in [*model.parameters(), *model.buffers()]:
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p.data_ptr() == embed.data_ptr() and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def _loadavg() -> list[float]:
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return []

