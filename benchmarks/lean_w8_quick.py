"""Indicative decode-step timing at 1K context, 1 thread, interleaved in one process: fp32 and bf16
model(...), bf16 through the lean decoder, bf16 with weight-only INT8 through the lean decoder
(`streaming` budget 1,024 + slack 64; 25 timed steps after 5 warm-up; medians). Not the issue-17
benchmark (that is `confkv bench --dtype ...`); a quick check of the levers.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lean_w8_quick.py
"""
import time, statistics, torch, copy
from confkv.models import load_model
from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LeanDecoder
from confkv.hf.weights import quantize_linear_weights
from confkv.config import StoreConfig
torch.set_num_threads(1)
m32, tok = load_model("smollm2", dtype=torch.float32)
m16, _ = load_model("smollm2", dtype=torch.bfloat16)
m8 = copy.deepcopy(m16); quantize_linear_weights(m8)
ids = torch.randint(1, 40000, (1, 1100), generator=torch.Generator().manual_seed(0))
variants = [("fp32 model()", m32, False), ("bf16 model()", m16, False), ("bf16 lean", m16, True), ("bf16w8 lean", m8, True)]
runs = []
for name, m, lean in variants:
    c = ConfKVCache.for_model(m, "streaming", budget=1024, store=StoreConfig(evict_slack=64))
    prefill(m, c, ids[:, :1024], chunk=256)
    runs.append((name, m, c, LeanDecoder(m) if lean else None, []))
with torch.no_grad():
    for t in range(1024, 1054):
        for name, m, c, dec, ts in runs:
            s = time.perf_counter()
            if dec is None: m(input_ids=ids[:, t:t+1], cache=c, logits_to_keep=1)
            else: dec(ids[:, t:t+1], c)
            ts.append(time.perf_counter() - s)
base = statistics.median(runs[0][4][5:])
for name, m, c, dec, ts in runs:
    med = statistics.median(ts[5:]); print(f"{name:14s} {med*1e3:6.1f} ms  x{base/med:.2f} (vs fp32 model(...), 1K context, 1 thread)")
