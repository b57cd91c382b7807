"""benchmarks/niah_table.py: counts per length and accuracy relative to full on the same samples."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "niah_table.py"
spec = importlib.util.spec_from_file_location("niah_table", SCRIPT)
niah_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(niah_table)


def _record(policy, length, depth, correct, protocol="streaming"):
    return {"policy": policy, "protocol": protocol, "length": length, "depth": depth, "trial": 0, "correct": correct}


def test_table_counts_and_relative_accuracy():
    records = [_record("full", 1024, 0.0, True), _record("full", 4096, 0.0, True), _record("full", 4096, 0.5, False),
               _record("window", 1024, 0.0, True), _record("window", 4096, 0.0, False),
               _record("window", 4096, 0.5, True), _record("h2o", 1024, 0.0, True), _record("h2o", 4096, 0.0, False)]
    text = niah_table.table(records, evicting_from=4096)
    rows = {line.split(" | ")[1]: line for line in text.splitlines()[2:]}
    assert rows["full"] == "| streaming | full | 1/1 | 1/2 | 1.00 (2/2) | 1.00 (1/1) |"
    # window finds one needle full missed and misses one full found: 2 found vs full's 2 overall, 1 vs 1 at 4K
    assert rows["window"] == "| streaming | window | 1/1 | 1/2 | 1.00 (2/2) | 1.00 (1/1) |"
    assert rows["H2O"] == "| streaming | H2O | 1/1 | 0/1 | 0.50 (1/2) | 0.00 (0/1) |"
    assert "query-aware" not in text


def test_relative_is_dash_without_full_hits():
    records = [_record("full", 4096, 0.0, False), _record("h2o", 4096, 0.0, True)]
    assert niah_table.relative(records, "h2o", "streaming", {4096}) == "-"


def test_depth_table_counts_per_depth():
    records = [_record("full", 4096, 0.0, False), _record("full", 4096, 0.5, True),
               _record("window", 4096, 0.0, False), _record("window", 4096, 0.5, False)]
    lines = niah_table.depth_table(records, [4096]).splitlines()
    assert lines[0] == "| protocol | policy | length | depth 0 | depth 0.5 |"
    assert lines[2] == "| streaming | full | 4K | 0/1 | 1/1 |"
    assert lines[3] == "| streaming | window | 4K | 0/1 | 0/1 |"


def test_length_labels():
    assert [niah_table.length_label(n) for n in (1024, 8192, 32000)] == ["1K", "8K", "32,000"]


def test_records_of_an_earlier_preset_are_labelled_apart_and_unknown_names_sort_by_name():
    from confkv.presets import preset_signature

    today = {**_record("tiered", 4096, 0.0, True), "preset": preset_signature("tiered")}
    before = _record("tiered", 4096, 0.5, False)  # written before records carried the signature
    marked = niah_table.mark_earlier_presets([today, before, _record("full", 4096, 0.0, True)])
    assert [r["policy"] for r in marked] == ["tiered", "tiered (earlier preset)", "full"]
    assert niah_table.in_label_order({"zeta", "tiered", "full", "alpha"}) == ["full", "alpha", "tiered", "zeta"]


def test_records_run_with_their_own_parameters_are_labelled_by_them():
    from confkv.presets import preset_signature

    ladder = {**_record("tiered", 8192, 0.25, True), "preset": preset_signature("tiered"),
              "params": {"ladder": [8, 4], "memory": 0.25}}
    plain = {**_record("tiered", 8192, 0.25, False), "preset": preset_signature("tiered"), "params": {"memory": 0.25}}
    marked = niah_table.mark_earlier_presets([ladder, plain])
    assert [r["policy"] for r in marked] == ["tiered (ladder=[8, 4])", "tiered"]
