"""Speed: ``confkv bench`` (run: the runner; configs: the rows it compares; loops: the timed loops; output: tables and plot; machine; dtypes),
the llama.cpp peer row (llamacpp, llamacpp_worker), the attention-read micro-benchmark, the lean native step,
the serving load test, and which files one decode step enters (step_trace)."""

from confkv._moved import old_module_names

# the old module confkv.eval.bench is this package now: its names, for one release
__getattr__ = old_module_names(__name__, "confkv.eval.bench.run",
                               ("BenchConfig", "default_configs", "run_bench", "POLICY_SECTIONS", "step_breakdown",
                                "_Runner"))
