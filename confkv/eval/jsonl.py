"""Append-only JSONL files that survive a kill: one complete line per row, fsynced.

Used by the resumable sweeps (:mod:`confkv.eval.quality.sweep`, :mod:`confkv.eval.niah`): a run
appends its rows when they are complete; a kill in the middle of a write leaves at most
one torn last line, which :func:`load_rows` cuts off, so no row is lost or duplicated.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows already on disk; a torn last line is cut off (the file is truncated to its last newline)."""
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        cut = raw.rfind(b"\n") + 1
        with open(path, "r+b") as handle:
            handle.truncate(cut)
            handle.flush()
            os.fsync(handle.fileno())
        raw = raw[:cut]
    rows = []
    for line in raw.decode("utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def append_rows(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append ``rows``, one complete line each, in one write, flushed and fsynced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
    if not text:
        return
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def append_row(path: str | Path, row: dict[str, Any]) -> None:
    """Append one row (see :func:`append_rows`)."""
    append_rows(path, [row])
