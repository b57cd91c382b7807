"""Per-module table of a mutmut run (``make mutate``), written into docs/MUTATION.md.

Reads mutmut 3's result files (``mutants/**/*.py.meta``: mutant name -> pytest exit code) and
the equivalent mutants listed in docs/MUTATION.md (lines ``- `<mutant name>`: <reason>``), and
replaces the text between the ``<!-- mutation-table -->`` markers of docs/MUTATION.md with:

    module | mutants | killed | timeout | equivalent | survived | not run | % of non-equivalent killed

* killed: a test failed (exit codes 1/3), or the tests crashed on a signal (SIGSEGV, SIGABRT, SIGFPE, SIGBUS,
  SIGILL: exit codes -11/-6/-8/-7/-4, as mutmut reports "segfault" and "suspicious"), which fails the run as surely;
* timeout: mutmut stopped the tests at its CPU-time limit (counted as killed, as mutmut does);
* equivalent: survived and listed in docs/MUTATION.md with its reason;
* survived: survived (exit 0), no selected test calls its function, or any other outcome, and not listed;
* not run: not checked yet (an interrupted or partial run), excluded from the percentage.

Usage: ``python benchmarks/mutation_table.py [--check]`` (``--check``: print only, do not write).
A run of some modules only (``mutmut run "confkv.tiers.ladder.*" ...``; ``make mutate MUTANTS=...`` would also
rewrite the whole-core table from its partial results) gets a table of its own:
``--modules confkv/tiers/ladder.py ...`` (globs) keeps those modules' rows, ``--table NAME`` writes between
``<!-- mutation-table:NAME -->`` markers, ``--mutants DIR`` reads another checkout's ``mutants/``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "MUTATION.md"
BEGIN, END = "<!-- mutation-table -->", "<!-- /mutation-table -->"
KILLED_CODES = {1, 3, -11, -6, -8, -7, -4}  # test failures, pytest internal error; the tests killed by a signal
TIMEOUT_CODES = {24, -24, 152, 255, 36}
EQUIVALENT_LINE = re.compile(r"^- `([\w.ǁ]+__mutmut_\d+)`: \S")


def equivalent_mutants(doc: str) -> set[str]:
    """Mutant names listed as equivalent (one line each, with a reason) in MUTATION.md."""
    return {m.group(1) for line in doc.splitlines() if (m := EQUIVALENT_LINE.match(line))}


def load_results(mutants_dir: Path) -> dict[str, int | None]:
    """mutant name -> exit code (None: not checked) over every ``.meta`` file."""
    results: dict[str, int | None] = {}
    for meta in sorted(mutants_dir.rglob("*.py.meta")):
        results.update(json.loads(meta.read_text())["exit_code_by_key"])
    return results


def module_of(mutant: str) -> str:
    """``confkv.policies.h2o.xǁH2OPolicyǁobserve__mutmut_3`` -> ``confkv/policies/h2o.py``;
    a package's own functions (mutmut drops ``__init__``) -> ``confkv/attention/__init__.py``."""
    parts = mutant.split(".")
    function_index = next(i for i, p in enumerate(parts) if p.startswith("x_") or p.startswith("xǁ"))
    module = "/".join(parts[:function_index])
    return f"{module}/__init__.py" if (ROOT / module).is_dir() else f"{module}.py"


def table(results: dict[str, int | None], equivalent: set[str]) -> tuple[str, list[str]]:
    """The markdown table and the non-equivalent survivors."""
    rows: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    survivors = []
    for name, code in sorted(results.items()):
        row = rows[module_of(name)]
        row["mutants"] += 1
        if code is None or code == 2:
            row["not run"] += 1
        elif code in KILLED_CODES:
            row["killed"] += 1
        elif code in TIMEOUT_CODES:
            row["timeout"] += 1
        elif name in equivalent:
            row["equivalent"] += 1
        else:
            row["survived"] += 1
            survivors.append(f"{name} (exit {code})")
    lines = ["| module | mutants | killed | timeout | equivalent | survived | not run | % of non-equivalent killed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    total: dict[str, int] = defaultdict(int)
    for module in sorted(rows) + ["**core total**"]:
        row = total if module == "**core total**" else rows[module]
        if row is not total:
            for key, value in row.items():
                total[key] += value
        judged = row["killed"] + row["timeout"] + row["survived"]
        percent = f"{100 * (row['killed'] + row['timeout']) / judged:.1f}" if judged else "-"
        lines.append(f"| {module} | {row['mutants']} | {row['killed']} | {row['timeout']} | {row['equivalent']} | "
                     f"{row['survived']} | {row['not run']} | {percent} |")
    return "\n".join(lines), survivors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print the table, do not write docs/MUTATION.md")
    parser.add_argument("--survivors", action="store_true", help="also list the non-equivalent survivors")
    parser.add_argument("--modules", nargs="+", help="only these modules' rows (globs: confkv/tiers/*.py)")
    parser.add_argument("--table", help="write between <!-- mutation-table:TABLE --> markers instead")
    parser.add_argument("--mutants", type=Path, default=ROOT / "mutants", help="mutmut's directory (default: ./mutants)")
    args = parser.parse_args(argv)
    results = load_results(args.mutants)
    if args.modules:
        results = {name: code for name, code in results.items()
                   if any(fnmatch.fnmatch(module_of(name), pattern) for pattern in args.modules)}
    if not results:
        print(f"no mutmut results under {args.mutants}{' for those modules' if args.modules else ''}: "
              "run `make mutate` first", file=sys.stderr)
        return 1
    doc = DOC.read_text()
    text, survivors = table(results, equivalent_mutants(doc))
    print(text)
    if args.survivors:
        print("\n".join(survivors))
    if not args.check:
        begin, end = (f"<!-- mutation-table:{args.table} -->", f"<!-- /mutation-table:{args.table} -->") if args.table \
            else (BEGIN, END)
        if begin not in doc or end not in doc:
            print(f"{DOC}: markers {begin} / {end} missing", file=sys.stderr)
            return 1
        head, rest = doc.split(begin, 1)
        DOC.write_text(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
