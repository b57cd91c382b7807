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
line is run again, a line moved by an edit above it keeps its verdicts under its new id, and the ids that no longer
exist are dropped), so an interrupted run resumes where it stopped; ``--rerun survived`` re-tests the survivors not listed as equivalent (after new tests), ``--rerun equivalent``
those listed (with ``--sanitize address``: whether any reads or writes out of bounds), ``--sample N`` runs a
seeded sample of N mutants spread over the files (the full set takes hours on two cores). The table of
docs/MUTATION.md (between ``<!-- native-mutation-table -->`` markers) is rewritten at the end.

``--sanitize address`` builds and tests each mutant under AddressSanitizer: a mutant whose only effect is a read or
write past a malloc'd block or a stack array (which the plain tests cannot see) is killed, and its verdict says so;
``--sanitize thread`` under ThreadSanitizer, with the worker pool's chunks split statically over the threads
(``CONFKV_POOL_STATIC``): a mutant whose only effect is a race between two threads' chunks is killed
(a mutant killed there is run once more without the sanitizer: if the plain tests kill it too, the verdict is a
plain kill). ``--sanitize undefined`` under UBSan, aborting at the first report: a mutant whose only effect is
undefined behaviour that this compiler's code happens to survive (an index one past a fixed-size array such as
the AVX-512 loops' register arrays, a shift by the type's width or more, a signed overflow) is killed.

The mutants are made in ``benchmarks/native_mutants.py``, the verdicts kept and the table written in
``benchmarks/native_verdicts.py``; this script runs them.

Usage: ``python benchmarks/mutate_native.py [--sample N] [--rerun survived] [--sanitize address|thread|undefined]
[--only ID[,ID...]] [--list] [--table-only]``
(``make mutate-native``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native_mutants import apply, mutants  # noqa: E402  (the mutants: benchmarks/native_mutants.py)
# the verdicts and the table (benchmarks/native_verdicts.py); BEGIN, END, still_valid, table: re-exported for the tests
from native_verdicts import (BEGIN, DOC, END, STORE, equivalent, record, rename_listed,  # noqa: E402
                             still_valid, table, verdicts_now, write_table)

ROOT = Path(__file__).resolve().parent.parent
#: the tests that exercise the kernels, fastest files first (pytest -x stops at the first failure)
TESTS = ["tests/native/test_native_pool.py", "tests/native/test_native_contracts.py", "tests/native/test_native_confidence.py", "tests/native/test_native_w8a8.py",
         "tests/native/test_native_w4a8.py", "tests/native/test_native_gemv.py", "tests/native/test_native_kernels.py", "tests/native/test_native_layer.py",
         "tests/store/test_window_buffer.py", "tests/native/test_native_prefill.py", "tests/native/test_native_pages.py",
         "tests/native/test_native_page_formats.py", "tests/native/test_native_outlier_repeats.py",
         "tests/native/test_native_channel_bits.py", "tests/native/test_native_decode_plan.py",
         "tests/native/test_native_evict.py", "tests/native/test_age_evict.py", "tests/store/test_read_updates.py",
         "tests/native/test_keep_pages.py", "tests/native/test_int8_rows.py", "tests/native/test_page_encode.py"]
#: per mutated file, the test files that call its code (common.h: all of them), in the order of TESTS
TESTS_FOR = {
    "c/mass_read.c": ["test_native_contracts", "test_native_kernels", "test_native_layer", "test_window_buffer"],
    "c/decode_step.c": ["test_native_contracts", "test_window_buffer", "test_native_kernels", "test_native_decode_plan"],
    "c/rows.c": ["test_native_contracts", "test_native_confidence", "test_native_kernels", "test_native_layer"],
    "c/gemv.c": ["test_native_contracts", "test_native_w8a8", "test_native_w4a8", "test_native_gemv", "test_native_layer"],
    "c/gemv_w4.c": ["test_native_w4a8"],
    "c/gemv_calls.c": ["test_native_contracts", "test_native_w8a8", "test_native_w4a8", "test_native_gemv",
                       "test_native_layer"],
    "c/layer.c": ["test_native_contracts", "test_native_layer", "test_native_w8a8", "test_native_w4a8"],  # the fused
    # W8A8 and W4A8 layers
    "c/pages.c": ["test_native_pages", "test_native_page_formats", "test_native_outlier_repeats",
                  "test_native_channel_bits"],
    "c/page_codes.c": ["test_native_pages", "test_native_page_formats"],
    "c/page_simd.c": ["test_native_pages", "test_native_page_formats", "test_native_outlier_repeats"],
    "c/page_avx2.c": ["test_native_pages", "test_native_page_formats", "test_native_outlier_repeats",
                      "test_native_channel_bits"],  # the values of per-channel-width pages
    "c/page_widths.c": ["test_native_page_formats", "test_native_outlier_repeats", "test_native_channel_bits"],
    "c/page_tasks.c": ["test_native_pages", "test_native_page_formats", "test_native_outlier_repeats",
                       "test_native_channel_bits", "test_read_updates"],
    "c/prefill.c": ["test_native_prefill"],
    "c/evict.c": ["test_native_evict", "test_age_evict"],
    "c/page_moves.c": ["test_keep_pages"],
    "c/int8_rows.c": ["test_int8_rows", "test_page_encode"],  # its float16 rounding encodes pages too
    "c/page_encode.c": ["test_page_encode"],
    "c/pool.c": ["test_native_pool", "test_native_contracts", "test_native_w8a8", "test_native_w4a8", "test_native_gemv",
                 "test_native_kernels", "test_native_layer", "test_native_prefill"],
}
#: loader tests that build libraries of their own and test no kernel
DESELECT = ["tests/native/test_native_kernels.py::test_the_library_is_cached_by_source_flags_and_compiler",
            "tests/native/test_native_kernels.py::test_a_changed_part_of_the_source_builds_a_new_library"]




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
    from confkv.native.loader import SANITIZER_RUNTIMES  # noqa: PLC0415

    cc = os.environ.get("CC") or "cc"
    library = f"{SANITIZER_RUNTIMES[name]}.so"
    runtime = subprocess.run([cc, f"-print-file-name={library}"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(runtime):
        sys.exit(f"--sanitize {name}: {cc} has no {library}; install the compiler's sanitizer runtime")
    return {"CONFKV_NATIVE_SANITIZE": name, "LD_PRELOAD": runtime,
            "ASAN_OPTIONS": "detect_leaks=0:allocator_may_return_null=1:malloc_fill_byte=255:max_malloc_fill_size=1048576", "UBSAN_OPTIONS": "print_stacktrace=1",
            "TSAN_OPTIONS": "halt_on_error=1 die_after_fork=0 allocator_may_return_null=1 suppressions="
                            + str(Path(__file__).resolve().parents[1] / "tests/native/tsan_suppressions.txt")}


#: words of the skip reasons of tests/native that mean "the library did not load" (a CPU without AVX512-BF16 skips
#: tests for its own reasons, which are no sign of it)
LIBRARY_SKIPS = ("native kernels", "needs the library")


def ran_without_library(output: str) -> bool:
    """Whether pytest's ``output`` (its ``-rs`` summary) shows tests skipped because the library was unavailable."""
    if "native kernels unavailable" in output:
        return True
    skips = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    return any(word in line for line in skips for word in LIBRARY_SKIPS)


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
    if not tests:  # pytest without paths would run the whole default suite and call its first failure a kill
        sys.exit(f"no test of TESTS runs for {file or 'this mutant'} (TESTS_FOR names {wanted}); add its tests to TESTS")
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
        if ran_without_library(output):
            return "load-error", seconds, output[-500:]  # the tests ran without the library: not a verdict
        return "survived", seconds, ""
    return "killed", seconds, output[-300:]




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=0, help="a seeded sample of N mutants (0: all)")
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--rerun", choices=["survived", "equivalent", "all"],
                        help="re-test these outcomes (default: only new); equivalent: the survivors listed as "
                             "equivalent (with --sanitize: does any of them read or write out of bounds?)")
    parser.add_argument("--only", default="", help="only mutants whose id contains this text (or one of several, "
                                                   "joined by commas)")
    parser.add_argument("--lines", default="", help="only mutants on lines A-B (with --only naming one file)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from the results and exit")
    parser.add_argument("--sanitize", choices=["", "address", "thread", "undefined"], default="",
                        help="build and test each mutant under AddressSanitizer (LD_PRELOAD of the compiler's "
                             "libasan): a read or write past a malloc'd block or a stack array kills it; or under "
                             "ThreadSanitizer (libtsan; the pool's chunks split statically over two threads): a "
                             "race between two chunks kills it; or under UBSan (libubsan): an index past a "
                             "fixed-size array, a shift past the type's width, a signed overflow kills it")
    args = parser.parse_args()
    every = mutants()
    texts = args.only.split(",")
    chosen = [m for m in every if any(text in m.id for text in texts)]
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
    results, renamed = verdicts_now(json.loads(STORE.read_text()) if STORE.exists() else {}, every)
    if renamed:  # lines moved by an edit above them: their verdicts (kept) and their ids in the doc follow
        DOC.write_text(rename_listed(DOC.read_text(), renamed))
        STORE.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"{len(renamed)} verdicts follow their moved lines (ids renamed in {DOC.name})", flush=True)
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
