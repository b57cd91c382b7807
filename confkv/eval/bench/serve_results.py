"""What a finished run of :mod:`confkv.eval.bench.serve_load` says: its summary lines, the flat-memory
check (RSS after N requests against after the last), and the answers of two runs of one load compared
(:func:`comparable` says whether they can be).

Every function takes the run's result (the dict ``serve_load`` prints and writes with ``--out``)."""

from __future__ import annotations

import argparse
import shlex
from typing import Any


def flat_memory(result: dict[str, Any], after: int) -> dict[str, float] | None:
    """The server's RSS once ``after`` requests had ended against its RSS once the last had ended.

    Returns ``{"after": n, "rss_after": bytes, "last": N, "rss_last": bytes, "growth": fraction}``, or
    None when the run ended fewer than ``after`` requests (or sampled no RSS: a ``--url`` server).
    """
    samples = result.get("rss_by_requests") or []
    if after < 1 or len(samples) <= after:
        return None
    rss_after, (last, rss_last) = samples[after - 1][1], samples[-1]
    return {"after": after, "rss_after": rss_after, "last": last, "rss_last": rss_last,
            "growth": rss_last / rss_after - 1}


def same_answers(result: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """The answers of two runs of the same load (same ``--seed``, prompts and lengths), request by request:
    ``{"compared": requests completed in both, "equal": of them with the same token ids, "different":
    the first 10 indices that differ}``. :func:`comparable` checks ``other`` before the load is run."""
    def answers(run: dict[str, Any]) -> dict[int, list[int]]:
        return {o["index"]: o["token_ids"] for o in run["outcomes"]
                if o["status"] == "completed" and o.get("index", -1) >= 0}
    mine, theirs = answers(result), answers(other)
    common = sorted(set(mine) & set(theirs))
    different = [i for i in common if mine[i] != theirs[i]]
    return {"compared": len(common), "equal": len(common) - len(different), "different": different[:10]}


def summary_lines(result: dict[str, Any]) -> list[str]:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1000:.0f} ms"

    def mib(value: float | None) -> str:
        return "n/a" if not value else f"{value / 2**20:.1f} MiB"

    lines = [
        f"requests {result['requests']} from {result['clients']} clients "
        + (f"to {result['server']}: " if result.get("server", "confkv serve") != "confkv serve"
           else f"at memory {result['memory']}: ")
        + f"completed {result['completed']}, failed {result['failed']}, lost {result['lost']}"
        + (f", not sent {result['not_sent']} ("
           + (f"stopped by {result['stopped_by']}" if result.get("stopped_by") else "past --max-seconds") + ")"
           if result.get("not_sent") else ""),
        f"time to first token p50 {ms(result['ttft_p50_s'])}, p99 {ms(result['ttft_p99_s'])}",
        f"inter-token latency p50 {ms(result['itl_p50_s'])}, p99 {ms(result['itl_p99_s'])}",
        f"generated {result['generated_tokens']} tokens in {result['wall_s']:.1f} s: "
        f"{result['tokens_per_s']:.2f} tokens/s ({result['prompt_tokens']} prompt tokens)",
        f"peak RSS of the server {mib(result['peak_rss_bytes'])}",
        f"peak KV bytes held {result['peak_kv_bytes']:.0f} against the running requests' targets summed "
        f"{result['target_bytes_at_peak']:.0f} at that step"
        if result.get("peak_kv_bytes") is not None else "peak KV bytes: n/a",
    ]
    same = result.get("same_answers")
    if same:
        lines.append(f"answers equal to {same['against']}'s: {same['equal']} of the {same['compared']} requests "
                     f"both runs completed" + (f" (differ: {same['different']})" if same["different"] else ""))
    flat = result.get("flat_memory")
    if flat:
        lines.append(f"server RSS after {flat['after']} requests {mib(flat['rss_after'])}, after {flat['last']} "
                     f"{mib(flat['rss_last'])} ({flat['growth']:+.2%})")
    return lines


#: the options that make a load: two runs with the same values send the same requests
LOAD_OPTIONS = ("model", "requests", "prompt_tokens", "new_tokens", "memory", "seed", "corpus")


def comparable(earlier: dict[str, Any], load: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """Why the answers of run ``earlier`` (a ``--out`` JSON) cannot be compared with a run of ``load`` (this
    run's options), or None when they can: its command is parsed again by ``parser`` (serve_load's) and its
    load options compared."""
    words = shlex.split(earlier.get("command", ""))
    if words[:3] != ["python", "-m", "confkv.eval.bench.serve_load"]:
        return "it is not the JSON of a serve_load run (no command recorded)"
    try:
        theirs = parser.parse_args(words[3:])
    except SystemExit:
        return f"its command does not parse: {earlier['command']}"
    for key in LOAD_OPTIONS:
        if getattr(theirs, key) != getattr(load, key):
            return (f"it ran another load (--{key.replace('_', '-')} {getattr(theirs, key)}, this run "
                    f"{getattr(load, key)}): give both runs the same load options")
    if not any(o.get("token_ids") for o in earlier.get("outcomes", [])):
        return ("it holds no answers (a text-only peer, or a run from before answers were recorded): "
                "compare with a confkv run made by this version")
    return None
