"""Micro-benchmark of weight-only INT8 against F.linear on the SmolLM2 projection shapes (1 thread,
one token): float32, bfloat16, int8 weights with float32 and with bfloat16 activations; prints
microseconds per call and the int8 product error against the float32 one.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/int8_matmul_micro.py
"""
import torch, time
torch.set_num_threads(1)
def bench(f, n=50):
    for _ in range(5): f()
    s=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-s)/n*1e6
for (i,o) in [(576,1536),(1536,576),(576,49152)]:
    w=torch.randn(o,i); x=torch.randn(1,i)
    wb=w.bfloat16(); xb=x.bfloat16()
    scale=w.abs().amax(1)/127; w8=(w/scale[:,None]).round().clamp(-127,127).to(torch.int8)
    r=[]
    r.append(bench(lambda: torch.nn.functional.linear(x,w)))
    r.append(bench(lambda: torch.nn.functional.linear(xb,wb)))
    try:
        r.append(bench(lambda: torch._weight_int8pack_mm(x, w8, scale)))
        r.append(bench(lambda: torch._weight_int8pack_mm(xb, w8, scale.bfloat16())))
    except Exception as e: print(e)
    err=(torch._weight_int8pack_mm(x, w8, scale)-x@w.T).abs().max()
    print(f"in {i} out {o}: fp32 {r[0]:.0f} us, bf16 {r[1]:.0f} us, int8 w + fp32 x {r[2]:.0f} us, int8 w + bf16 x {r[3]:.0f} us, max err {float(err):.3f}")
