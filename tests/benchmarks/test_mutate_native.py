"""benchmarks/mutate_native.py: the C mutants it makes (never in comments or preprocessor lines), the mutated
copy it builds from, and the per-file table of docs/MUTATION.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mutate_native", ROOT / "benchmarks" / "mutate_native.py")
mutate_native = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("mutate_native", mutate_native)  # dataclasses look their module up there
_spec.loader.exec_module(mutate_native)

SOURCE = """/* a comment: a + b, x < y, round_to(p, q) */
#define WIDTH (1 + 2)
static float f(const float *a, int64_t n, int d) {
    float s = 0.0f; // n - 1
    for (int64_t i = 0; i < n; i++) s = fmaf(a[i], a[i], s);
    return round_to(s * 2.0f, d) - a[0] / s;
}
"""


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "c").mkdir(parents=True)
    (tmp_path / "kernels.c").write_text('#include "c/part.c"\n')
    (tmp_path / "c" / "part.c").write_text(SOURCE)
    return tmp_path


def test_mutants_cover_each_kind_outside_comments_and_preprocessor_lines(tmp_path):
    found = mutate_native.mutants(_tree(tmp_path))
    assert all(m.file == "c/part.c" and m.line >= 3 for m in found)  # nothing from the comment, #define, kernels.c
    by_kind = {}
    for m in found:
        by_kind.setdefault(m.kind, []).append((m.old, m.new))
    assert sorted(by_kind["arith"]) == [(" * ", " / "), (" - ", " + "), (" / ", " * ")]
    assert by_kind["compare"] == [(" < ", " <= ")]
    assert by_kind["bound"] == [("for (int64_t i = 0; i < n;", "for (int64_t i = 0; i < (n) - 1;")]
    assert by_kind["start"] == [("for (int64_t i = 0;", "for (int64_t i = 1;")]
    assert by_kind["no-round"] == [("round_to(s * 2.0f, d)", "(s * 2.0f)")]
    assert by_kind["split-fma"] == [("fmaf(a[i], a[i], s)", "((a[i]) * (a[i]) + (s))")]
    assert ("a[0] / s", "s / a[0]") in by_kind["swap"]
    assert len({m.id for m in found}) == len(found)


def test_apply_changes_one_place_in_a_copy(tmp_path):
    source = _tree(tmp_path / "src")
    mutant = next(m for m in mutate_native.mutants(source) if m.kind == "no-round")
    mutate_native.apply(mutant, source, tmp_path / "copy")
    text = (tmp_path / "copy" / "c" / "part.c").read_text()
    assert text == SOURCE.replace("round_to(s * 2.0f, d)", "(s * 2.0f)")
    assert (source / "c" / "part.c").read_text() == SOURCE  # the original untouched
    assert (tmp_path / "copy" / "kernels.c").exists()


def test_the_table_counts_each_outcome_and_the_listed_equivalents(tmp_path):
    found = mutate_native.mutants(_tree(tmp_path))
    outcomes = ["killed", "killed", "timeout", "compile-error", "survived", "survived", "survived", "survived"]
    results = {m.id: {"outcome": o, "old": m.old, "new": m.new} for m, o in zip(found, outcomes)}
    doc = (f"- `native:{found[4].id}`: the same value either way\n"
           f"- `native:{found[5].id}`, `native:{found[6].id}`: scheduling only, see `native:{found[7].id}`\n"
           f"{mutate_native.BEGIN}\n- `native:{found[7].id}`: a survivor in the table\n{mutate_native.END}\n")
    table = mutate_native.table(results, found, doc)
    row = next(line for line in table.splitlines() if line.startswith("| `c/part.c`"))
    # mutants, run, killed, timeout, compile error, equivalent, survived, killed of the non-equivalent (3 of 4)
    assert row == f"| `c/part.c` | {len(found)} | 8 | 2 | 1 | 1 | 3 | 1 | 75.0% |"
    assert f"`native:{found[7].id}`" in table and f"`native:{found[4].id}`" not in table  # only the unlisted one


def test_every_test_a_file_names_is_one_the_runs_take():
    """A mutated file's tests are picked from TESTS by name: a test module named in TESTS_FOR but missing from
    TESTS would not run (with none left, pytest ran the whole default suite and its first unrelated failure read as
    a kill: stop 54, every mutant of c/evict.c; the script now stops there), and one missing on disk would never run."""
    stems = {Path(t).stem for t in mutate_native.TESTS}
    for file, modules in mutate_native.TESTS_FOR.items():
        assert set(modules) <= stems, (file, set(modules) - stems)
        assert (ROOT / "confkv" / "native" / file).exists(), file
    assert all((ROOT / t).exists() for t in mutate_native.TESTS)


def test_a_verdict_holds_only_while_its_line_reads_the_same(tmp_path):
    """The verdicts live in the repository across sessions: one of a line edited since, or of an id that no longer
    exists, is dropped (and run again when chosen); one of an unchanged line is kept."""
    found = mutate_native.mutants(_tree(tmp_path))
    loop = next(m for m in found if m.kind == "compare")
    assert loop.line_text == "for (int64_t i = 0; i < n; i++) s = fmaf(a[i], a[i], s);"
    results = {m.id: mutate_native.record(m, "killed", 1.0, "tail") for m in found}
    results["c/part.c:99:arith:4000"] = {"outcome": "killed", "new": " - ", "line": "gone"}
    assert mutate_native.still_valid(results, found).keys() == {m.id for m in found}
    assert "tail" not in results[loop.id]  # a kill's output is not kept
    assert mutate_native.record(loop, "survived", 1.0, "x" * 500)["tail"] == "x" * 300
    # one line edited, its length kept (so the next line's mutants keep their ids)
    (tmp_path / "c" / "part.c").write_text(SOURCE.replace("fmaf(a[i], a[i], s)", "fmaf(a[i], a[i], 0)"))
    edited = mutate_native.mutants(tmp_path)
    kept = mutate_native.still_valid(results, edited)
    same_id = next(m for m in edited if m.id == loop.id)
    assert same_id.line_text != loop.line_text and loop.id not in kept  # the same place, the line edited: run again
    last_line = {m.id for m in edited if m.line == 6}
    assert last_line and kept.keys() == last_line  # the untouched line's verdicts stay


def test_kills_under_the_sanitizer_are_counted_and_named_and_survivals_there_still_equivalent(tmp_path):
    """A verdict reached under ``--sanitize address`` says so: a kill counts as killed and is named in its own list
    (an access out of bounds the plain tests cannot see); a listed equivalent that survived the sanitizer stays
    equivalent. Without a sanitizer the run's environment is the plain one."""
    found = mutate_native.mutants(_tree(tmp_path))
    results = {found[0].id: {"outcome": "killed", "old": found[0].old, "new": found[0].new, "sanitizer": "address"},
               found[1].id: {"outcome": "survived", "old": found[1].old, "new": found[1].new, "sanitizer": "address"},
               found[2].id: {"outcome": "killed", "old": found[2].old, "new": found[2].new}}
    doc = f"- `native:{found[1].id}`: the same value either way\n"
    table = mutate_native.table(results, found, doc)
    row = next(line for line in table.splitlines() if line.startswith("| `c/part.c`"))
    assert row == f"| `c/part.c` | {len(found)} | 3 | 2 | 0 | 0 | 1 | 0 | 100.0% |"
    named = table.split("Killed in a run under AddressSanitizer", 1)[1]
    assert f"`native:{found[0].id}`" in named and f"`native:{found[2].id}`" not in named
    assert mutate_native.sanitizer_env("") == {}


MOVED_SOURCE = """static float g(const float *a, float s) {
    s = a[0] * a[1] * a[2];
    s = s - a[3];
    s = s - a[3];
    return s;
}
"""


def test_a_verdict_follows_its_line_when_an_edit_above_moves_it(tmp_path):
    """An edit above a line shifts its line number and offset, so its mutants' ids: their verdicts follow them
    (the same line text, change and place on the line: two `*` on one line keep theirs apart), and so do the ids
    listed in the doc. A line whose text repeats in the file is run again instead (which copy was which is not
    known), and so is the edited line."""
    tree = _tree(tmp_path)
    (tree / "c" / "part.c").write_text(MOVED_SOURCE)
    before = mutate_native.mutants(tree)
    outcomes = {m.id: ("killed" if n % 2 else "survived") for n, m in enumerate(before)}
    results = {m.id: mutate_native.record(m, outcomes[m.id], 1.0, "") for m in before}
    (tree / "c" / "part.c").write_text("/* a new first line */\nstatic int h(int x) { return x + 1; }\n" +
                                       MOVED_SOURCE)
    after = mutate_native.mutants(tree)
    kept, renamed = mutate_native.verdicts_now(results, after)
    products = [m for m in before if m.line_text.startswith("s = a[0]") and m.kind == "arith"]
    assert len(products) == 2 and {outcomes[m.id] for m in products} == {"killed", "survived"}
    for m in products:
        now = renamed[m.id]
        moved_to = next(x for x in after if x.id == now)
        assert moved_to.line == m.line + 2 and moved_to.start > m.start and moved_to.old == m.old
        assert moved_to.start - m.start == len("/* a new first line */\nstatic int h(int x) { return x + 1; }\n")
        assert kept[now]["outcome"] == outcomes[m.id]  # each `*` its own verdict
    assert not any(m.line_text.startswith("s = s - a[3]") for m in before if m.id in renamed)  # repeated text
    assert set(renamed.values()) <= kept.keys() and not set(renamed) & kept.keys()
    doc = f"- `native:{products[0].id}`: a reason\n- `native:c/other.c:1:arith:5`: kept as it is\n"
    assert mutate_native.rename_listed(doc, renamed) == \
        f"- `native:{renamed[products[0].id]}`: a reason\n- `native:c/other.c:1:arith:5`: kept as it is\n"
    # the same line edited: nothing follows
    (tree / "c" / "part.c").write_text(MOVED_SOURCE.replace("a[0] * a[1] * a[2]", "a[0] * a[1] * a[3]"))
    kept, renamed = mutate_native.verdicts_now(results, mutate_native.mutants(tree))
    assert not renamed and not any(i in kept for i in (m.id for m in products))


def test_tests_skipped_for_a_cpu_feature_are_no_sign_of_a_missing_library():
    """A CPU without AVX512-BF16 skips a few tests for that reason: the run is still a verdict (a machine without the
    feature could not run mutants at all when any skip counted as "the library did not load"); skips because the
    library is unavailable are not."""
    feature = ("SKIPPED [1] tests/native/test_native_prefill.py:319: this CPU has no AVX512-BF16\n"
               "1391 passed, 36 skipped, 2 deselected in 345.12s")
    assert not mutate_native.ran_without_library(feature)
    for reason in ("native kernels unavailable (no C compiler or CONFKV_NATIVE=0; see the warning)",
                   "no C compiler: the native kernels are off", "the eviction's C call needs the library"):
        assert mutate_native.ran_without_library(f"SKIPPED [4] tests/native/test_x.py:12: {reason}\n4 skipped in 1.0s")
    assert mutate_native.ran_without_library("UserWarning: confkv: native kernels unavailable\n3 passed in 1.0s")
