"""RULER (Hsieh et al., 2024): tasks (offline generators), score (its scoring), grid (``confkv ruler``: the grid,
resuming, its table and plot)."""

from confkv._moved import old_module_names

# the old module confkv.eval.ruler is this package now: its names, for one release
__getattr__ = old_module_names(__name__, "confkv.eval.ruler.grid",
                               ("RULER_VERSION", "RulerConfig", "RulerRecord", "RulerUnit", "parse_policy_spec",
                                "run_key", "record_key", "run_ruler_unit", "run_ruler_grid", "write_ruler",
                                "ruler_table", "summarize"))
