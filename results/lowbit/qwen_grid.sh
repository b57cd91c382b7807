#!/bin/sh
# Issue 31's Qwen2.5-1.5B replay rows (pydoc-topics, 2,048 tokens): resumable (a rerun computes only the cells missing
# from the .jsonl), one thread, niced. Stop 73 ran it from a worktree of b1d80c9 (the outlier pick before stop 73),
# writing into main's results/lowbit/proxy_qwen.jsonl.
cd "$(dirname "$0")/../.." || exit 1
P="env PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python benchmarks/lowbit_proxy.py --model qwen2.5-coder-1.5b --compute float32 --out results/lowbit/proxy_qwen.jsonl"
$P --bits 16 4 3 2 --format kivi --sinks 0 4
$P --bits 4 --value-bits 2 --format hadamard+outliers+clip hadamard+clip --sinks 4
$P --bits 3 2 4 --format hadamard+outliers+clip hadamard+outliers+channel_bits hadamard+outliers+codebook --sinks 4
$P --bits 3 2 4 --format hadamard outliers codebook clip channel_bits prerope
echo GRID DONE
