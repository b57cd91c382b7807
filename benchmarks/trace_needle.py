"""Where a needle's tokens are in the preset's cache after each 512-token chunk of the NIAH streaming protocol.

Prints, after each chunk, how many of the needle's tokens each region holds (``old`` / ``recent``: the hot tier;
``r8`` / ``r4`` / ``r3``: ladder rungs; ``open0``: the top rung's open page) in layers 0, 15 and 29 of SmolLM2
(head union, batch 1), then the answer. Usage::

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/trace_needle.py LENGTH DEPTH TRIAL ["{'unread_by': 'attention'}"]
"""
import ast
import sys

import torch

from confkv.models.loading import load_model
from confkv.data.needles import make_niah_sample
from confkv.hf import ConfKVCache, prefill

length = int(sys.argv[1]); depth = float(sys.argv[2]); trial = int(sys.argv[3])
extra = ast.literal_eval(sys.argv[4]) if len(sys.argv) > 4 else {}
torch.set_num_threads(1)
model, tok = load_model("smollm2", dtype=torch.bfloat16)
s = make_niah_sample(tok, context_tokens=length, depth=depth, trial=trial)
needle = set(range(s.needle_position, s.needle_position + s.needle_length))
print("needle at", s.needle_position, "len", s.needle_length, "answer", s.answer)
cache = ConfKVCache.for_model(model, memory=0.25, **extra)

def where(store):
    out = {}
    for name in ("old", "recent"):
        r = getattr(store, name)
        if r is not None:
            p = r.positions[0][r.valid[0][None].expand_as(r.positions[0])] if r.valid.dim() == 2 else r.positions[0]
            out[name] = set(p.flatten().tolist()) & needle
    cold = store.cold
    if cold is not None:
        for i, rung in enumerate(cold.rungs):
            if rung.num_pages:
                pos = rung.pages["positions"][0, :, :rung.num_pages]
                val = rung.pages["valid"][0, :, :rung.num_pages]
                if val.shape != pos.shape: val = val.expand_as(pos)
                out[f"r{cold.storage.ladder[i]}"] = set(pos[val].tolist()) & needle
            if rung.open is not None and rung.open["positions"].numel():
                out[f"open{i}"] = set(rung.open["positions"][0].flatten().tolist()) & needle
    return {k: len(v) for k, v in out.items() if v}

ctx = s.context_ids
for start in range(0, ctx.shape[1], 512):
    prefill(model, cache, ctx[:, start:start + 512], chunk=512)
    print(start + 512, "L0", where(cache.layers[0].store), "L15", where(cache.layers[15].store), "L29", where(cache.layers[29].store))
prefill(model, cache, s.question_ids[:, :-1], chunk=512)
out = model.generate(input_ids=s.input_ids, attention_mask=torch.ones_like(s.input_ids), cache=cache, do_sample=False, max_new_tokens=10, pad_token_id=tok.eos_token_id)
print(repr(tok.decode(out[0, s.input_ids.shape[1]:])))
