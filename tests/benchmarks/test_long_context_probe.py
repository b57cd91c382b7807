"""benchmarks/long_context_probe.py: a short run prints the step, every section of the preset's step per layer,
and holds the target (the probe's cache is the preset's)."""

import importlib.util
import re
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "long_context_probe.py"
spec = importlib.util.spec_from_file_location("long_context_probe", SCRIPT)
long_context_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(long_context_probe)


def test_a_short_probe_prints_the_sections_of_the_presets_step(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["long_context_probe.py", "--context", "600", "--steps", "2", "--query-heads",
                                      "4", "--kv-heads", "2", "--head-dim", "64", "--chunk", "256"])
    long_context_probe.main()
    out = capsys.readouterr().out
    assert re.search(r"prefill of 600 tokens: \d+ s; KV held [\d.]+ MiB", out)
    assert re.search(r"step [\d.]+ ms over 2 layers", out)
    sections = dict(re.findall(r"^(attention read|ageing \+ eviction \(one call\)|memory plan)\s+([\d.]+)\s+\d+$",
                               out, re.M))
    assert set(sections) == {"attention read", "ageing + eviction (one call)", "memory plan"}, out
    assert all(float(ms) > 0 for ms in sections.values())
