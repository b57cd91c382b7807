"""The NIAH grid as a Markdown table, from a `confkv niah` results file (no model run).

One row per protocol and policy: needles found / samples at each length, accuracy relative
to full KV on the same samples over all lengths, and over the lengths where the fixed
budget is smaller than the prompt (the only ones that test retention). Usage::

    .venv/bin/python benchmarks/niah_table.py results/niah_grid/niah.json --evicting-from 4096
    .venv/bin/python benchmarks/niah_table.py results/niah_grid/niah.json --by-depth 4096,8192
    # several results files join into one table (e.g. a new policy's grid next to full KV's):
    .venv/bin/python benchmarks/niah_table.py results/niah_grid/niah.json results/archive/niah_tiered/niah.json --trials 2
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

LABELS = {"full": "full", "window": "window", "streaming": "StreamingLLM", "h2o": "H2O", "tova": "TOVA",
          "confkv": "CONF-KV", "confkv+int8": "CONF-KV+INT8", "kivi": "KIVI", "quest": "Quest",
          "confkv-r": "CONF-KV-R"}


def length_label(tokens: int) -> str:
    """4096 -> '4K'; a length that is not a multiple of 1024 keeps its digits (32000 -> '32,000')."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else f"{tokens:,}"


def in_label_order(policies: set[str]) -> list[str]:
    """``policies`` in the order of ``LABELS`` (unknown names last)."""
    order = list(LABELS)
    return sorted(policies, key=lambda p: (order.index(p) if p in order else len(order), p))  # unknown: by name


def header(columns: list[str]) -> list[str]:
    """A Markdown table's header and separator lines."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def relative(records: list[dict], policy: str, protocol: str, lengths: set[int]) -> str:
    """Found by ``policy`` / found by full, over the samples both have, at ``lengths``."""
    full = {(r["length"], r["depth"], r["trial"]): r["correct"] for r in records
            if r["policy"] == "full" and r["protocol"] == protocol}
    mine = [(r["correct"], full[key]) for r in records
            if r["policy"] == policy and r["protocol"] == protocol and r["length"] in lengths
            and (key := (r["length"], r["depth"], r["trial"])) in full]
    base = sum(f for _, f in mine)
    if not mine or not base:
        return "-"
    return f"{sum(c for c, _ in mine) / base:.2f} ({sum(c for c, _ in mine)}/{base})"


def table(records: list[dict], evicting_from: int) -> str:
    lengths = sorted({r["length"] for r in records})
    cells: dict[tuple[str, str], dict[int, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        cells[(r["protocol"], r["policy"])][r["length"]].append(bool(r["correct"]))
    long = {n for n in lengths if n >= evicting_from}
    head = ["protocol", "policy", *[length_label(n) for n in lengths], "vs full, all",
            f"vs full, >= {length_label(evicting_from)}"]
    lines = header(head)
    for protocol in ("streaming", "query-aware"):
        for policy in in_label_order({p for q, p in cells if q == protocol}):
            row = cells[(protocol, policy)]
            counts = [f"{sum(row[n])}/{len(row[n])}" if row[n] else "-" for n in lengths]
            lines.append("| " + " | ".join([protocol, LABELS.get(policy, policy), *counts,
                                            relative(records, policy, protocol, set(lengths)),
                                            relative(records, policy, protocol, long)]) + " |")
    return "\n".join(lines)


def depth_table(records: list[dict], lengths: list[int]) -> str:
    """Found / samples per needle depth at each of ``lengths``, one row per protocol, policy, length."""
    cells: dict[tuple, list[bool]] = defaultdict(list)
    for r in records:
        cells[(r["protocol"], r["policy"], r["length"], float(r["depth"]))].append(bool(r["correct"]))
    depths = sorted({key[3] for key in cells})
    head = ["protocol", "policy", "length", *[f"depth {d:g}" for d in depths]]
    lines = header(head)
    for protocol in ("streaming", "query-aware"):
        for length in lengths:
            for policy in in_label_order({k[1] for k in cells if k[0] == protocol and k[2] == length}):
                found = [cells.get((protocol, policy, length, d), []) for d in depths]
                lines.append("| " + " | ".join([protocol, LABELS.get(policy, policy), length_label(length),
                                                *[f"{sum(f)}/{len(f)}" if f else "-" for f in found]]) + " |")
    return "\n".join(lines)


def read_records(path: Path) -> list[dict]:
    """The records of a ``niah.json`` (a finished run) or of its ``niah.jsonl`` (the resumable
    rows, one per line, readable while a grid is still running)."""
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())["records"]


#: record params that set the memory target, not the policy or its storage
TARGET_PARAMS = ("memory", "max_kv_bytes")


def mark_earlier_presets(records: list[dict]) -> list[dict]:
    """Records run with parameters of their own (``--param``) get the policy ``"<name> (k=v, ...)"``;
    records of a preset computed under other defaults than today's get ``"<name> (earlier preset)"``,
    so that neither counts as today's preset."""
    from confkv.presets import preset_signature  # noqa: PLC0415

    out = []
    for r in records:
        overrides = {k: v for k, v in (r.get("params") or {}).items() if k not in TARGET_PARAMS}
        if overrides:
            r = {**r, "policy": f"{r['policy']} ({', '.join(f'{k}={v}' for k, v in sorted(overrides.items()))})"}
        elif (now := preset_signature(r["policy"])) is not None and r.get("preset") != now:
            r = {**r, "policy": f"{r['policy']} (earlier preset)"}
        out.append(r)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("niah_json", type=Path, nargs="+", help="one or more niah.json / niah.jsonl files (records joined)")
    parser.add_argument("--evicting-from", type=int, default=4096,
                        help="first length where the fixed budget is smaller than the prompt")
    parser.add_argument("--by-depth", type=str, default="",
                        help="comma-separated lengths: print found / samples per depth at these instead")
    parser.add_argument("--trials", type=int, default=None,
                        help="only trials 0 .. N-1 (to set a partial grid beside a complete one)")
    args = parser.parse_args()
    records = mark_earlier_presets([r for path in args.niah_json for r in read_records(path)
                                    if args.trials is None or r["trial"] < args.trials])
    if args.by_depth:
        print(depth_table(records, [int(n) for n in args.by_depth.split(",")]))
    else:
        print(table(records, args.evicting_from))


if __name__ == "__main__":
    main()
