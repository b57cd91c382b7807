"""Evaluation, one sub-package per benchmark: quality (perplexity, sweeps, probe, guard, stream), niah, ruler,
agent, bench (speed, serving load, the decode step's files), ray (grids on Ray), report (pages and plots);
jsonl.py: the append-only result files they share."""
