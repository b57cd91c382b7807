"""What ordering unread pages by attention costs: the ladder's page choice (``_coldest``) by age and by attention
on a rung of 128 pages x 3 KV heads (the preset's 8K context), and how often a per-token run calls it.

Usage: ``PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/unread_order_cost.py`` (the count runs SmolLM2 over
1,500 tokens of pydoc-topics at memory=0.25, a few minutes).
"""
import time

import torch

import confkv.tiers.ladder as ladder
from confkv.data import corpora
from confkv.hf import ConfKVCache
from confkv.models.loading import load_model
from confkv.tiers.ladder import LadderTier, _coldest
from confkv.tiers.storage import Storage

torch.set_num_threads(1)
P, H, D, N = 64, 3, 64, 128
tier = LadderTier(Storage(ladder=(3,), page_size=P, group_size=P, unread_by="attention", format="kivi+hadamard"))
tier.demote(torch.randn(1, H, N * P, D), torch.randn(1, H, N * P, D), torch.arange(N * P).expand(1, H, -1).clone(),
            torch.ones(1, N * P, dtype=torch.bool), torch.rand(1, H, N * P))
rung = tier.rungs[0]
assert rung.num_pages == N
for order in ("age", "attention", "age", "attention"):
    for _ in range(50):
        _coldest(rung, "heat", 1, order)
    t = time.perf_counter()
    for _ in range(2000):
        _coldest(rung, "heat", 1, order)
    print(order, f"{(time.perf_counter() - t) / 2000 * 1e6:.1f} us per call")

# how often a per-token run asks for it
model, tok = load_model("smollm2", dtype=torch.bfloat16)
calls = [0]
orig = ladder._coldest


def counted(*args, **kwargs):
    calls[0] += 1
    return orig(*args, **kwargs)


ladder._coldest = counted
ids = torch.tensor([tok(corpora.load_corpus("pydoc-topics"))["input_ids"][:1500]])
cache = ConfKVCache.for_model(model, memory=0.25, unread_by="attention")
per_step = []
with torch.no_grad():
    for t in range(ids.shape[1]):
        before = calls[0]
        model(ids[:, t:t + 1], cache=cache, use_cache=True)
        per_step.append(calls[0] - before)
last = per_step[500:]
print("steps", len(last), "calls", sum(last), "per step", sum(last) / len(last), "max", max(last))
