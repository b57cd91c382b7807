"""benchmarks/mutation_table.py: the per-module table of docs/MUTATION.md from mutmut's result files."""

import importlib.util
import json
from pathlib import Path


def _script():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "mutation_table.py"
    spec = importlib.util.spec_from_file_location("mutation_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_table_counts_each_outcome_per_module(tmp_path):
    script = _script()
    meta = tmp_path / "confkv" / "policies" / "h2o.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"exit_code_by_key": {
        "confkv.policies.h2o.x_f__mutmut_1": 1, "confkv.policies.h2o.x_f__mutmut_2": 0,
        "confkv.policies.h2o.x_f__mutmut_3": 0, "confkv.policies.h2o.xǁH2OPolicyǁobserve__mutmut_1": -24,
        "confkv.policies.h2o.x_f__mutmut_4": None, "confkv.policies.h2o.x_f__mutmut_5": 33}}))
    doc = "- `confkv.policies.h2o.x_f__mutmut_2`: same value.\n- not a mutant line\n"
    equivalent = script.equivalent_mutants(doc)
    assert equivalent == {"confkv.policies.h2o.x_f__mutmut_2"}
    text, survivors = script.table(script.load_results(tmp_path), equivalent)
    row = next(line for line in text.splitlines() if line.startswith("| confkv/policies/h2o.py"))
    # 6 mutants: 1 killed, 1 timeout, 1 equivalent, 2 survived (exit 0, no test), 1 not run; 2 of 4 judged
    assert row == "| confkv/policies/h2o.py | 6 | 1 | 1 | 1 | 2 | 1 | 50.0 |"
    assert survivors == ["confkv.policies.h2o.x_f__mutmut_3 (exit 0)", "confkv.policies.h2o.x_f__mutmut_5 (exit 33)"]
    assert script.module_of("confkv.attention.x_attention_read__mutmut_1") == "confkv/attention/__init__.py"


def test_tests_killed_by_a_signal_count_as_killed(tmp_path):
    """mutmut's "segfault" (-11) and "suspicious" (-6, -8) outcomes: the tests crashed, so the mutant was seen."""
    script = _script()
    meta = tmp_path / "confkv" / "native" / "decode.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"exit_code_by_key": {f"confkv.native.decode.x_f__mutmut_{i}": code
                                                     for i, code in enumerate((-11, -6, -8, 0, 1))}}))
    text, survivors = script.table(script.load_results(tmp_path), set())
    assert "| confkv/native/decode.py | 5 | 4 | 0 | 0 | 1 | 0 | 80.0 |" in text
    assert survivors == ["confkv.native.decode.x_f__mutmut_3 (exit 0)"]


def test_a_run_of_some_modules_writes_their_rows_into_a_table_of_its_own(tmp_path, monkeypatch):
    script = _script()
    for module, code in (("h2o", 1), ("tova", 0)):
        meta = tmp_path / "mutants" / "confkv" / "policies" / f"{module}.py.meta"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"exit_code_by_key": {f"confkv.policies.{module}.x_f__mutmut_1": code}}))
    doc = tmp_path / "MUTATION.md"
    doc.write_text("<!-- mutation-table -->\nold\n<!-- /mutation-table -->\n"
                   "<!-- mutation-table:late -->\n<!-- /mutation-table:late -->\n")
    monkeypatch.setattr(script, "DOC", doc)
    assert script.main(["--mutants", str(tmp_path / "mutants"), "--modules", "confkv/policies/h2o.py",
                        "--table", "late"]) == 0
    text = doc.read_text()
    assert "<!-- mutation-table -->\nold\n<!-- /mutation-table -->" in text  # the main table untouched
    late = text.split("<!-- mutation-table:late -->\n", 1)[1]
    assert "| confkv/policies/h2o.py | 1 | 1 | 0 | 0 | 0 | 0 | 100.0 |" in late and "tova" not in late
    assert script.main(["--mutants", str(tmp_path / "mutants"), "--modules", "confkv/nothing.py", "--check"]) == 1
