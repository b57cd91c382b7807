"""The verdicts of benchmarks/mutate_native.py: the store in the repository (results/mutation/native.json: one
verdict per mutant id, kept while its line reads the same, following the line when an edit above moves it), the
mutants docs/MUTATION.md lists as equivalent, and the per-file table it writes there."""

from __future__ import annotations

import re
from pathlib import Path

from native_mutants import Mutant

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "MUTATION.md"
#: every verdict so far (see benchmarks/mutate_native.py's docstring)
STORE = ROOT / "results" / "mutation" / "native.json"
BEGIN, END = "<!-- native-mutation-table -->", "<!-- /native-mutation-table -->"
EQUIVALENT_LINE = re.compile(r"^- `native:([\w./:-]+)`(?:, `native:[\w./:-]+`)*: \S")


def equivalent(doc: str) -> set[str]:
    """Mutant ids listed as equivalent in MUTATION.md, outside the table (which lists the survivors): lines
    ``- `native:<id>`: <reason>``, or ``- `native:<id>`, `native:<id>`: <reason>`` for several."""
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        doc = head + rest.split(END, 1)[1]
    found = set()
    for line in doc.splitlines():
        if EQUIVALENT_LINE.match(line):
            reasonless = line.split("`: ", 1)[0] + "`"  # the ids before the first reason
            found.update(re.findall(r"`native:([\w./:-]+)`", reasonless))
    return found


def table(results: dict[str, dict], all_mutants: list[Mutant], doc: str) -> str:
    """The per-file table: mutants, run, killed, timeout, compile errors, equivalent, survived, % killed."""
    listed = equivalent(doc)
    rows, totals = [], None
    files = sorted({m.file for m in all_mutants})
    def counts(ids: list[str]) -> list[int]:
        outcome = [results.get(i, {}).get("outcome") for i in ids]
        killed = outcome.count("killed")
        timeout = outcome.count("timeout")
        errors = outcome.count("compile-error") + outcome.count("load-error")
        eq = sum(1 for i, o in zip(ids, outcome) if o == "survived" and i in listed)
        survived = sum(1 for i, o in zip(ids, outcome) if o == "survived" and i not in listed)
        run = killed + timeout + errors + eq + survived
        return [len(ids), run, killed, timeout, errors, eq, survived]
    lines = ["| file | mutants | run | killed | timeout | compile error | equivalent | survived | killed of non-equivalent |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in [*files, "all"]:
        ids = [m.id for m in all_mutants if name in ("all", m.file)]
        c = counts(ids)
        scored = c[2] + c[3] + c[6]
        share = f"{100 * (c[2] + c[3]) / scored:.1f}%" if scored else "-"
        label = "**all**" if name == "all" else f"`{name}`"
        lines.append(f"| {label} | " + " | ".join(str(x) for x in c) + f" | {share} |")
    what = {"address": ("AddressSanitizer", "accesses out of bounds"),
            "thread": ("ThreadSanitizer", "two threads touching the same memory unordered, one writing"),
            "undefined": ("UBSan", "undefined behaviour the compiled code happened to survive: an index past a "
                                   "fixed-size array, a shift past the type's width")}
    for name, (tool, seen) in what.items():
        sanitized = sorted(i for i, r in results.items()
                           if r.get("sanitizer") == name and r["outcome"] in ("killed", "timeout"))
        if sanitized:
            lines += ["", f"Killed in a run under {tool} (`--sanitize {name}`, run on the plain run's survivors: "
                          f"{seen}, which the plain tests cannot see): {len(sanitized)}, counted as killed above:", ""]
            lines += [f"- `native:{i}`" for i in sanitized]
    survivors = sorted(i for i, r in results.items() if r["outcome"] == "survived" and i not in listed)
    if survivors:
        lines += ["", "Survivors not yet killed nor listed as equivalent:", ""]
        lines += [f"- `native:{i}`: `{results[i]['old']}` -> `{results[i]['new']}`" for i in survivors]
    return "\n".join(lines)


def still_valid(results: dict[str, dict], every: list[Mutant]) -> dict[str, dict]:
    """The verdicts of ``results`` that still hold (:func:`verdicts_now`)."""
    return verdicts_now(results, every)[0]


def verdicts_now(results: dict[str, dict], every: list[Mutant]) -> tuple[dict[str, dict], dict[str, str]]:
    """The verdicts of ``results`` that still hold: those of a mutant that exists now (same id: file, line, kind,
    offset) whose line reads as it did when it was run, and those :func:`moved` carries to a mutant's new id;
    and those renamings (old id -> id now). Anything else is dropped, and run again when chosen."""
    by_id = {m.id: m for m in every}
    kept = {i: r for i, r in results.items()
            if i in by_id and r.get("line") == by_id[i].line_text and r.get("new") == by_id[i].new}
    renamed = moved(results, every, kept)
    kept.update({new_id: results[old_id] for old_id, new_id in renamed.items()})
    return kept, renamed


def moved(results: dict[str, dict], every: list[Mutant], kept: dict[str, dict]) -> dict[str, str]:
    """Old id -> id now, for verdicts whose line only moved (an edit above it shifted its line and offset): the
    same file, kind, line text, old and new text and place among such changes on its line, where exactly one
    verdict without a mutant now and exactly one mutant now without a verdict share them (a line whose text
    repeats in its file is run again instead)."""
    def keyed(entries: list[tuple[str, str, int, str, int, str, str, str]]) -> dict[tuple, list[str]]:
        """(id, file, line number, kind, offset, line text, old, new) -> {(file, kind, text, old, new, rank on
        its line): [ids]}"""
        groups: dict[tuple, list[tuple[int, str]]] = {}
        for i, file, line, kind, start, text, old, new in entries:
            groups.setdefault((file, line, kind, text, old, new), []).append((start, i))
        out: dict[tuple, list[str]] = {}
        for (file, _, kind, text, old, new), found in groups.items():
            for rank, (_, i) in enumerate(sorted(found)):
                out.setdefault((file, kind, text, old, new, rank), []).append(i)
        return out

    ids_now = {m.id for m in every}
    orphans = []
    for i, r in results.items():
        parts = i.rsplit(":", 3)
        if i not in ids_now and len(parts) == 4 and parts[1].isdigit() and parts[3].isdigit() and \
                {"line", "old", "new"} <= r.keys():
            orphans.append((i, parts[0], int(parts[1]), parts[2], int(parts[3]), r["line"], r["old"], r["new"]))
    waiting = keyed([(m.id, m.file, m.line, m.kind, m.start, m.line_text, m.old, m.new)
                     for m in every if m.id not in kept])
    return {ids[0]: waiting[key][0] for key, ids in keyed(orphans).items()
            if len(ids) == 1 and len(waiting.get(key, [])) == 1}


def rename_listed(doc: str, renamed: dict[str, str]) -> str:
    """``doc`` with every `native:<old id>` of ``renamed`` written as its id now (the equivalent list follows a
    mutant whose line moved)."""
    return re.sub(r"`native:([\w./:-]+)`", lambda m: f"`native:{renamed.get(m.group(1), m.group(1))}`", doc)


def record(mutant: Mutant, outcome: str, seconds: float, tail: str, sanitize: str = "") -> dict:
    """A verdict as stored: the output's tail only where someone will read it (a survivor, an error); a verdict
    reached under a sanitizer says which."""
    entry = {"outcome": outcome, "seconds": round(seconds, 1), "old": mutant.old, "new": mutant.new,
             "line": mutant.line_text}
    if sanitize:
        entry["sanitizer"] = sanitize
    if outcome not in ("killed", "timeout"):
        entry["tail"] = tail[-300:]
    return entry


def write_table(results: dict[str, dict], all_mutants: list[Mutant]) -> None:
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        print(table(results, all_mutants, doc))
        return
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{table(results, all_mutants, doc)}\n{END}{tail}")
