"""NIAH records: one per generation, the grid's result with its accuracies, and their files."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from confkv.eval.niah.config import NiahConfig


@dataclass
class NiahRecord:
    policy: str
    protocol: str
    length: int
    depth: float
    trial: int
    actual_depth: float
    answer: str
    generated: str
    correct: bool
    params: dict[str, Any]
    kept_at_answer: float  # mean over layers of tokens kept when the answer is generated
    peak_kv_bytes_per_seq: float  # trace peak / batch size
    seconds_per_seq: float
    run: str = ""  # run_key(): the settings shared by every record of the grid
    computed_in: str = ""  # the protocol whose computation produced it (full: one run for both)
    protocol_version: int = 1  # PROTOCOL_VERSIONS[protocol] when it was computed
    # of the peak, the bytes in RAM (less with an offloaded cold tier); None in records written before it existed
    peak_resident_bytes_per_seq: float | None = None
    # confkv.presets.preset_signature(policy) when it was computed: a preset whose defaults changed
    # since is computed again, not resumed (None: not a preset, or a record written before it existed)
    preset: str | None = None


@dataclass
class NiahResult:
    config: NiahConfig
    records: list[NiahRecord]
    budgets: dict[str, dict[str, Any]]  # "policy@length" -> params
    budget_bytes: dict[int, float]
    seconds: float
    model: str = ""

    def accuracy(self, policy: str, protocol: str, length: int | None = None, depth: float | None = None) -> float:
        rows = [r for r in self.records if r.policy == policy and r.protocol == protocol
                and (length is None or r.length == length) and (depth is None or r.depth == depth)]
        return sum(r.correct for r in rows) / len(rows) if rows else float("nan")

    def grid(self, policy: str, protocol: str) -> list[list[float]]:
        """[depth][length] accuracy."""
        return [[self.accuracy(policy, protocol, length, depth) for length in self.config.lengths]
                for depth in self.config.depths]

    def count(self, policy: str, protocol: str) -> int:
        return sum(1 for r in self.records if r.policy == policy and r.protocol == protocol)

    def relative_to_full(self, policy: str, protocol: str) -> float:
        """Accuracy / full-KV accuracy on the same samples (NaN without full records or hits)."""
        full = {(r.length, r.depth, r.trial): r.correct for r in self.records
                if r.policy == "full" and r.protocol == protocol}
        pairs = [(r.correct, full[(r.length, r.depth, r.trial)]) for r in self.records
                 if r.policy == policy and r.protocol == protocol and (r.length, r.depth, r.trial) in full]
        hits_full = sum(f for _, f in pairs)
        return sum(c for c, _ in pairs) / hits_full if hits_full else float("nan")

    def summary(self) -> dict[str, Any]:
        return {f"{policy}/{protocol}": self.accuracy(policy, protocol)
                for protocol in self.config.protocols for policy in self.config.policies}

    def summary_lines(self) -> list[str]:
        lines = []
        for protocol in self.config.protocols:
            for policy in self.config.policies:
                per_length = "  ".join(f"{length}:{self.accuracy(policy, protocol, length):.2f}"
                                       for length in self.config.lengths)
                lines.append(f"{protocol:12s} {policy:14s} acc {self.accuracy(policy, protocol):.3f}  "
                             f"vs full {self.relative_to_full(policy, protocol):.3f}  "
                             f"n={self.count(policy, protocol):4d}   {per_length}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        keys = [(p, q) for q in self.config.protocols for p in self.config.policies]
        return {"model": self.model, "config": asdict(self.config), "budgets": self.budgets,
                "budget_bytes": {str(k): v for k, v in self.budget_bytes.items()}, "seconds": self.seconds,
                "summary": self.summary(),
                "relative_to_full": {f"{p}/{q}": self.relative_to_full(p, q) for p, q in keys},
                "counts": {f"{p}/{q}": self.count(p, q) for p, q in keys},
                "grids": {f"{p}/{q}": self.grid(p, q) for p, q in keys},
                "records": [asdict(r) for r in self.records]}

def record_key(record: "NiahRecord | dict[str, Any]") -> tuple:
    """What identifies one NIAH generation (resuming skips keys already on disk)."""
    r = asdict(record) if isinstance(record, NiahRecord) else record
    return (r["run"], r["policy"], r["protocol"], r["length"], float(r["depth"]), r["trial"], r.get("preset"))


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``niah.jsonl`` (a torn last line from a kill is cut off)."""
    from confkv.eval.jsonl import load_rows

    return load_rows(path)


def write_niah(result: NiahResult, out_dir: str | Path) -> list[Path]:
    """``niah.json`` (config, budgets, grids, records) and ``niah.csv`` (one row per sample)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / "niah.json", out_dir / "niah.csv"
    json_path.write_text(json.dumps(result.to_dict(), indent=1))
    fields = ["policy", "protocol", "length", "depth", "trial", "actual_depth", "answer", "generated", "correct",
              "kept_at_answer", "peak_kv_bytes_per_seq", "peak_resident_bytes_per_seq", "seconds_per_seq",
              "computed_in", "protocol_version", "params", "preset"]
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for r in result.records:
            row = asdict(r)
            del row["run"]  # the same for every record; niah.json has the config
            row["params"] = json.dumps(row["params"], sort_keys=True)
            writer.writerow(row)
    return [json_path, csv_path]


