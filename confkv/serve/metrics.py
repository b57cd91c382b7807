"""The Prometheus text of ``confkv serve``'s ``/metrics``: KV bytes held (all tiers), per-request peaks,
tokens/s, queue depth and requests by outcome, read from the engine between steps."""

from __future__ import annotations

import os
from typing import Any


def render_metrics(server: Any) -> str:
    """The Prometheus text of ``/metrics`` for ``server`` (a :class:`confkv.serve.app.Server`)."""
    engine = server.engine
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{labels} {value}")

    metric("confkv_server_info", "gauge", "the serving process (one per replica under Ray Serve)",
           [(f'{{model="{server.model_name}",pid="{os.getpid()}"}}', 1)])
    metric("confkv_kv_bytes", "gauge", "KV bytes held now by the running requests' caches, all layers and tiers "
           "(offloaded cold pages included)", [("", engine.kv_bytes_held)])
    metric("confkv_kv_offloaded_bytes", "gauge", "of confkv_kv_bytes, the bytes in offloaded page files",
           [("", engine.offloaded_bytes_held)])
    metric("confkv_kv_target_bytes", "gauge", "the running requests' memory targets now, summed",
           [("", engine.target_bytes_held)])
    metric("confkv_kv_bytes_peak", "gauge", "the largest confkv_kv_bytes seen at a step boundary",
           [("", engine.peak_kv_bytes_held)])
    metric("confkv_kv_target_bytes_at_peak", "gauge", "confkv_kv_target_bytes when confkv_kv_bytes_peak was seen",
           [("", engine.target_bytes_at_peak)])
    metric("confkv_request_peak_kv_bytes", "summary", "per finished request: the peak KV bytes its cache held",
           [("_count", engine.request_peak_count), ("_sum", engine.request_peak_sum)])
    metric("confkv_request_peak_kv_bytes_max", "gauge", "the largest per-request peak KV bytes so far",
           [("", engine.request_peak_max)])
    running = list(engine.running)
    metric("confkv_running_request_kv_bytes", "gauge", "per running request: KV bytes now",
           [(f'{{request="{j.id}"}}', j.kv_bytes) for j in running])
    metric("confkv_running_request_peak_kv_bytes", "gauge", "per running request: its peak KV bytes so far",
           [(f'{{request="{j.id}"}}', j.peak_kv_bytes) for j in running])
    metric("confkv_generated_tokens_total", "counter", "tokens generated", [("", engine.generated_tokens)])
    metric("confkv_prompt_tokens_total", "counter", "prompt tokens fed", [("", engine.prompt_tokens)])
    metric("confkv_tokens_per_second", "gauge", "generated tokens per second over the last 10 s",
           [("", round(engine.tokens_per_second(), 3))])
    metric("confkv_queue_depth", "gauge", "requests waiting for a row", [("", engine.queue_depth)])
    metric("confkv_running_requests", "gauge", "requests in the running batch", [("", len(running))])
    metric("confkv_requests_total", "counter", "requests by outcome",
           [(f'{{outcome="{o}"}}', engine.outcomes.get(o, 0))
            for o in ("completed", "failed", "cancelled", "rejected")])
    return "\n".join(lines) + "\n"
