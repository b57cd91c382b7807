"""Micro-benchmark: the block-wise read against mass_read, both returning the attention mass, on
SmolLM2's decode shapes (1 query, 9 query heads over 3 KV heads, head dim 64; an old region of
L - 128 slots and an FP window of 128), float32 and bfloat16, interleaved in one process, 1
thread; prints the medians and their ratio.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mass_read_micro.py
"""
import torch, time, statistics
from confkv.attention import KVSegment
from confkv.attention.blockwise import blockwise_attention
from confkv.attention.mass_read import mass_read
torch.set_num_threads(1)
for dtype in (torch.float32, torch.bfloat16):
    for L in (1024, 8192):
        g = torch.Generator().manual_seed(0)
        segs = [KVSegment(torch.randn(1,3,n,64,generator=g).to(dtype), torch.randn(1,3,n,64,generator=g).to(dtype), None) for n in (L-128, 128)]
        q = torch.randn(1,9,1,64,generator=g).to(dtype)
        fs = {"blockwise": lambda: blockwise_attention(q, segs, 0.125, need_mass=True), "mass_read": lambda: mass_read(q, segs, 0.125)}
        ts = {k: [] for k in fs}
        for rep in range(30):
            for k, f in fs.items():
                s = time.perf_counter(); f(); ts[k].append(time.perf_counter() - s)
        med = {k: statistics.median(v[5:]) * 1e6 for k, v in ts.items()}
        print(f"{str(dtype):15s} L={L}: blockwise {med['blockwise']:.0f} us, mass_read {med['mass_read']:.0f} us, ratio {med['blockwise']/med['mass_read']:.2f}")
