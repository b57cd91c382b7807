"""Mutation testing of the native C kernels (confkv/native/kernels.c and c/*.c, c/*.h), which mutmut cannot reach.

Each mutant is one small textual change to one C file (see :func:`mutants`): an arithmetic operator swapped
(``+ -``, ``* /``), a comparison moved by one (``< <=``, ``> >=``) or negated (``== !=``), ``&& ||``
swapped, a loop bound made one shorter or a loop started at 1, a rounding to the activations' dtype
dropped (``round_to(x, d)`` -> ``x``), a fused multiply-add split into two roundings, or the operands of a
``-`` / ``/`` swapped. Comments and preprocessor lines are never mutated.

For each mutant the script writes a mutated copy of the sources, compiles it with the project's own
loader (``confkv.native.loader.build``; the tests then load it through ``$CONFKV_NATIVE_SOURCE``, the
library cached in a scratch ``$CONFKV_NATIVE_CACHE``), and runs the native tests that reach the mutated file
(:data:`TESTS_FOR`; :data:`TESTS` for common.h) in a subprocess with a timeout, stopping at the first failure.
Outcomes:

* killed: a test failed (or the process crashed on the mutant, e.g. a segfault);
* timeout: the tests ran past the limit (counted as killed);
* compile-error: the mutant does not compile (not a mutant, left out of the percentage);
* survived: every test passed. A survivor is killed by a new test or listed as equivalent, with its reason,
  in docs/MUTATION.md (lines ``- `native:<id>`: <reason>``).

The run works on a snapshot of confkv/, tests/ and benchmarks/ taken when it starts. Results go to
``results/mutation/native.json`` (in the repository, so a run spread over sessions and machines adds up), one
entry per mutant id with the text of the mutated line: a verdict holds while that line reads the same (a changed
line is run again, and the ids that no longer exist are dropped), so an interrupted run resumes where it stopped; ``--rerun survived`` re-tests the survivors not listed as equivalent (after new tests), ``--rerun equivalent``
those listed (with ``--sanitize address``: whether any reads or writes out of bounds), ``--sample N`` runs a
seeded sample of N mutants spread over the files (the full set takes hours on two cores). The table of
docs/MUTATION.md (between ``<!-- native-mutation-table -->`` markers) is rewritten at the end.

``--sanitize address`` builds and tests each mutant under AddressSanitizer: a mutant whose only effect is a read or
write past a malloc'd block or a stack array (which the plain tests cannot see) is killed, and its verdict says so
(a mutant killed there is run once more without the sanitizer: if the plain tests kill it too, the verdict is a
plain kill).

Usage: ``python benchmarks/mutate_native.py [--sample N] [--rerun survived] [--sanitize address] [--list]
[--table-only]``
(``make mutate-native``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "confkv" / "native"
DOC = ROOT / "docs" / "MUTATION.md"
#: every verdict so far (see the module docstring)
STORE = ROOT / "results" / "mutation" / "native.json"
BEGIN, END = "<!-- native-mutation-table -->", "<!-- /native-mutation-table -->"
#: the tests that exercise the kernels, fastest files first (pytest -x stops at the first failure)
TESTS = ["tests/native/test_native_pool.py", "tests/native/test_native_contracts.py", "tests/native/test_native_confidence.py", "tests/native/test_native_w8a8.py",
         "tests/native/test_native_gemv.py", "tests/native/test_native_kernels.py", "tests/native/test_native_layer.py",
         "tests/store/test_window_buffer.py", "tests/native/test_native_prefill.py", "tests/native/test_native_pages.py",
         "tests/native/test_native_page_formats.py", "tests/native/test_native_decode_plan.py"]
#: per mutated file, the test files that call its code (common.h: all of them), in the order of TESTS
TESTS_FOR = {
    "c/mass_read.c": ["test_native_contracts", "test_native_kernels", "test_native_layer", "test_window_buffer"],
    "c/decode_step.c": ["test_native_contracts", "test_window_buffer", "test_native_kernels", "test_native_decode_plan"],
    "c/rows.c": ["test_native_contracts", "test_native_confidence", "test_native_kernels", "test_native_layer"],
    "c/gemv.c": ["test_native_contracts", "test_native_w8a8", "test_native_gemv", "test_native_layer"],
    "c/gemv_calls.c": ["test_native_contracts", "test_native_w8a8", "test_native_gemv", "test_native_layer"],
    "c/layer.c": ["test_native_contracts", "test_native_layer", "test_native_w8a8"],  # w8a8: the fused W8A8 layer
    "c/pages.c": ["test_native_pages", "test_native_page_formats"],
    "c/page_codes.c": ["test_native_pages", "test_native_page_formats"],
    "c/page_tasks.c": ["test_native_pages", "test_native_page_formats"],
    "c/prefill.c": ["test_native_prefill"],
    "c/pool.c": ["test_native_pool", "test_native_contracts", "test_native_w8a8", "test_native_gemv", "test_native_kernels",
                 "test_native_layer", "test_native_prefill"],
}
#: loader tests that build libraries of their own and test no kernel
DESELECT = ["tests/native/test_native_kernels.py::test_the_library_is_cached_by_source_flags_and_compiler",
            "tests/native/test_native_kernels.py::test_a_changed_part_of_the_source_builds_a_new_library"]
EQUIVALENT_LINE = re.compile(r"^- `native:([\w./:-]+)`(?:, `native:[\w./:-]+`)*: \S")


@dataclass(frozen=True)
class Mutant:
    """One change: ``file`` (relative to confkv/native) with text[start:end] replaced by ``new``."""

    file: str
    line: int
    start: int
    end: int
    old: str
    new: str
    kind: str
    #: the mutated line as it reads unmutated (stripped): a verdict is kept only while the line reads the same
    line_text: str = ""

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.kind}:{self.start}"


def code_mask(text: str) -> list[bool]:
    """Per character of C source ``text``: True where it is code (not a comment, string, char literal or
    preprocessor line)."""
    mask = [True] * len(text)
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and text[i:].lstrip(" \t").startswith("#"):
            j = i
            while j < n:  # a preprocessor line, with its backslash continuations
                end = text.find("\n", j)
                end = n if end < 0 else end
                if end > 0 and text[end - 1] == "\\":
                    j = end + 1
                    continue
                j = end
                break
            for k in range(i, j):
                mask[k] = False
            i = j
            continue
        line_start = False
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j += 1
        else:
            if c == "\n":
                line_start = True
            i += 1
            continue
        for k in range(i, min(j, n)):
            mask[k] = False
        i = j
    return mask


def _close_paren(text: str, open_at: int) -> int:
    """Index of the ``)`` matching the ``(`` at ``open_at``."""
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError("unbalanced parentheses")


def _split_args(inner: str) -> list[str]:
    """Top-level comma-separated arguments of a call's inside."""
    args, depth, start = [], 0, 0
    for i, c in enumerate(inner):
        depth += {"(": 1, ")": -1, "[": 1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            args.append(inner[start:i].strip())
            start = i + 1
    args.append(inner[start:].strip())
    return args


_SIMPLE = r"[A-Za-z_]\w*(?:\[[^\[\]]*\])?"
_RULES: list[tuple[str, re.Pattern, object]] = [
    # (kind, pattern, replacement: a dict old -> new for the whole match, or a function of the match)
    ("arith", re.compile(r"(?<=[\w)\]]) ([-+*/]) (?=[\w(])"), {"+": " - ", "-": " + ", "*": " / ", "/": " * "}),
    ("compare", re.compile(r" (<=|>=|<|>|==|!=) "), {"<": " <= ", "<=": " < ", ">": " >= ", ">=": " > ",
                                                        "==": " != ", "!=": " == "}),
    ("logic", re.compile(r" (&&|\|\|) "), {"&&": " || ", "||": " && "}),
    ("swap", re.compile(rf"(?<![\w.>*/])({_SIMPLE}) ([-/]) ({_SIMPLE})(?![\w\[(.])"),
     lambda m: f"{m.group(3)} {m.group(2)} {m.group(1)}"),
    ("bound", re.compile(r"(for \([^;]*; \w+ <=? )([^;]+)(;)"), lambda m: f"{m.group(1)}({m.group(2)}) - 1{m.group(3)}"),
    ("start", re.compile(r"(for \((?:const )?(?:int64_t|int) \w+ = )0(;)"), lambda m: f"{m.group(1)}1{m.group(2)}"),
]


def mutants(root: Path = NATIVE) -> list[Mutant]:
    """Every mutant of kernels.c and c/*.[ch], in file and position order, duplicates (same text) removed."""
    found: list[Mutant] = []
    files = [root / "kernels.c", *sorted((root / "c").glob("*.[ch]"))]
    for path in files:
        text = path.read_text()
        rel = str(path.relative_to(root))
        mask = code_mask(text)
        def add(start: int, end: int, new: str, kind: str) -> None:
            if all(mask[start:end]) and text[start:end] != new:
                line_start = text.rfind("\n", 0, start) + 1
                line_end = text.find("\n", start)
                line = text[line_start:len(text) if line_end < 0 else line_end].strip()
                found.append(Mutant(rel, text.count("\n", 0, start) + 1, start, end, text[start:end], new, kind, line))
        for kind, pattern, replace in _RULES:
            for m in pattern.finditer(text):
                new = replace[m.group(1)] if isinstance(replace, dict) else replace(m)
                add(m.start(), m.end(), new, kind)
        for name in ("round_to", "fmaf"):  # dropped roundings
            for m in re.finditer(rf"\b{name}\(", text):
                if not mask[m.start()] or text[m.start() - 7:m.start()].endswith("float "):  # not the definition
                    continue
                close = _close_paren(text, m.end() - 1)
                args = _split_args(text[m.end():close])
                if name == "round_to" and len(args) == 2:
                    add(m.start(), close + 1, f"({args[0]})", "no-round")
                elif name == "fmaf" and len(args) == 3:
                    add(m.start(), close + 1, f"(({args[0]}) * ({args[1]}) + ({args[2]}))", "split-fma")
    unique, seen = [], set()
    for mutant in found:
        key = (mutant.file, mutant.start, mutant.end, mutant.new)
        if key not in seen:
            seen.add(key)
            unique.append(mutant)
    return unique


def apply(mutant: Mutant, source: Path, target: Path) -> None:
    """A copy of the sources at ``source`` in ``target`` with ``mutant`` applied."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    shutil.copy(source / "kernels.c", target / "kernels.c")
    shutil.copytree(source / "c", target / "c")
    path = target / mutant.file
    text = path.read_text()
    assert text[mutant.start:mutant.end] == mutant.old, mutant
    path.write_text(text[:mutant.start] + mutant.new + text[mutant.end:])


def snapshot(target: Path) -> Path:
    """A copy of the package, the tests and pyproject.toml in ``target`` (the run's own: edits made to the
    working tree while it runs change nothing); returns ``target``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for name in ("confkv", "tests", "benchmarks"):
        shutil.copytree(ROOT / name, target / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", target / "pyproject.toml")
    return target


def sanitizer_env(name: str) -> dict[str, str]:
    """The environment that builds the kernels with sanitizer ``name`` (confkv.native.loader.SANITIZERS) and loads
    its runtime first in the test process (as ``make sanitize-native``); {} for none."""
    if not name:
        return {}
    cc = os.environ.get("CC") or "cc"
    runtime = subprocess.run([cc, f"-print-file-name=lib{name[:1]}san.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(runtime):
        sys.exit(f"--sanitize {name}: {cc} has no lib{name[:1]}san.so; install the compiler's sanitizer runtime")
    return {"CONFKV_NATIVE_SANITIZE": name, "LD_PRELOAD": runtime,
            "ASAN_OPTIONS": "detect_leaks=0:allocator_may_return_null=1"}


def run_tests(root: Path, source: Path, cache: Path, timeout: float, file: str | None = None,
              sanitize: str = "") -> tuple[str, float, str]:
    """Build the sources at ``source`` and run :data:`TESTS` of ``root`` (a :func:`snapshot`) on them, those of
    :data:`TESTS_FOR` ``file`` when it names a mutated file listed there: (outcome, seconds, tail of the output).
    ``sanitize``: build and run under that sanitizer (a mutant that reads or writes out of bounds is killed)."""
    env = {**os.environ, "CONFKV_NATIVE_SOURCE": str(source), "CONFKV_NATIVE_CACHE": str(cache),
           "OMP_NUM_THREADS": "1", "CONFKV_NATIVE": "1", **sanitizer_env(sanitize)}
    build = [sys.executable, "-c", "from confkv.native import loader; loader.build()"]
    done = subprocess.run(build, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        return "compile-error", 0.0, done.stderr[-500:]
    wanted = TESTS_FOR.get(file or "")
    tests = [t for t in TESTS if (root / t).exists() and (wanted is None or Path(t).stem in wanted)]
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
               *tests, *(f"--deselect={d}" for d in DESELECT)]
    began = time.monotonic()
    try:
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - began, ""
    seconds = time.monotonic() - began
    output = done.stdout + done.stderr
    if done.returncode == 0:
        if "native kernels unavailable" in output or " skipped" in output.splitlines()[-1]:
            return "load-error", seconds, output[-500:]  # the tests ran without the library: not a verdict
        return "survived", seconds, ""
    return "killed", seconds, output[-300:]


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
    sanitized = sorted(i for i, r in results.items() if r.get("sanitizer") and r["outcome"] in ("killed", "timeout"))
    if sanitized:
        lines += ["", f"Killed in a run under AddressSanitizer (`--sanitize address`, run on the plain run's survivors: "
                      f"accesses out of bounds that the plain tests cannot see): {len(sanitized)}, counted as killed "
                      "above:", ""]
        lines += [f"- `native:{i}`" for i in sanitized]
    survivors = sorted(i for i, r in results.items() if r["outcome"] == "survived" and i not in listed)
    if survivors:
        lines += ["", "Survivors not yet killed nor listed as equivalent:", ""]
        lines += [f"- `native:{i}`: `{results[i]['old']}` -> `{results[i]['new']}`" for i in survivors]
    return "\n".join(lines)


def still_valid(results: dict[str, dict], every: list[Mutant]) -> dict[str, dict]:
    """The verdicts of ``results`` that still hold: those of a mutant that exists now (same id: file, line, kind,
    offset) whose line reads as it did when it was run. Anything else is dropped, and run again when chosen."""
    by_id = {m.id: m for m in every}
    return {i: r for i, r in results.items()
            if i in by_id and r.get("line") == by_id[i].line_text and r.get("new") == by_id[i].new}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=0, help="a seeded sample of N mutants (0: all)")
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--rerun", choices=["survived", "equivalent", "all"],
                        help="re-test these outcomes (default: only new); equivalent: the survivors listed as "
                             "equivalent (with --sanitize: does any of them read or write out of bounds?)")
    parser.add_argument("--only", default="", help="only mutants whose id contains this text")
    parser.add_argument("--lines", default="", help="only mutants on lines A-B (with --only naming one file)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from the results and exit")
    parser.add_argument("--sanitize", choices=["", "address"], default="",
                        help="build and test each mutant under AddressSanitizer (LD_PRELOAD of the compiler's "
                             "libasan): a read or write past a malloc'd block or a stack array kills it")
    args = parser.parse_args()
    every = mutants()
    chosen = [m for m in every if args.only in m.id]
    if args.lines:
        first, _, last = args.lines.partition("-")
        if not (first.isdigit() and last.isdigit()):
            sys.exit(f"--lines: {args.lines!r} is not A-B (line numbers)")
        chosen = [m for m in chosen if int(first) <= m.line <= int(last)]
    if args.sample and args.sample < len(chosen):
        chosen = sorted(random.Random(args.seed).sample(chosen, args.sample), key=lambda m: (m.file, m.start))
    if args.list:
        for m in chosen:
            print(f"{m.id}\t{m.old!r} -> {m.new!r}")
        print(f"{len(chosen)} of {len(every)} mutants", file=sys.stderr)
        return
    STORE.parent.mkdir(parents=True, exist_ok=True)
    results = still_valid(json.loads(STORE.read_text()) if STORE.exists() else {}, every)
    if args.table_only:
        write_table(results, every)
        return
    scratch = Path(tempfile.mkdtemp(prefix="confkv-mutate-"))
    try:
        root = snapshot(scratch / "root")
        native = root / "confkv" / "native"
        outcome, baseline, tail = run_tests(root, native, scratch / "cache-clean", timeout=1200, sanitize=args.sanitize)
        if outcome != "survived":
            sys.exit(f"the unmutated sources do not pass the native tests ({outcome}):\n{tail}")
        timeout = 3 * baseline + 60
        print(f"baseline {baseline:.0f} s; timeout {timeout:.0f} s; {len(chosen)} mutants", flush=True)
        redo = {"survived": {"survived"}, "equivalent": {"survived"}, "all": None}.get(args.rerun or "", set())
        listed = equivalent(DOC.read_text()) if args.rerun in ("survived", "equivalent") else set()
        for n, mutant in enumerate(chosen, 1):
            previous = results.get(mutant.id)
            if previous is not None and not (redo is None or previous["outcome"] in redo):
                continue
            if previous is not None and args.rerun == "survived" and mutant.id in listed:  # listed as equivalent
                continue
            if args.rerun == "equivalent" and (mutant.id not in listed or  # only those listed, once per sanitizer
                                               (previous or {}).get("sanitizer", "") == args.sanitize != ""):
                continue
            apply(mutant, native, scratch / "src")
            outcome, seconds, tail = run_tests(root, scratch / "src", scratch / "cache", timeout, mutant.file,
                                               args.sanitize)
            shutil.rmtree(scratch / "cache", ignore_errors=True)
            by = args.sanitize
            if by and outcome in ("killed", "timeout"):  # would the plain tests kill it too (a test added since)?
                plain, seconds_plain, tail_plain = run_tests(root, scratch / "src", scratch / "cache", timeout,
                                                             mutant.file)
                shutil.rmtree(scratch / "cache", ignore_errors=True)
                if plain in ("killed", "timeout"):
                    outcome, seconds, tail, by = plain, seconds_plain, tail_plain, ""
            results[mutant.id] = record(mutant, outcome, seconds, tail, by)
            STORE.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
            print(f"[{n}/{len(chosen)}] {outcome:13s} {seconds:5.1f}s {mutant.id} {mutant.old!r} -> {mutant.new!r}",
                  flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_table(results, every)


if __name__ == "__main__":
    main()
