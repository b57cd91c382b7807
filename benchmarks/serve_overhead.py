"""The engine of `confkv serve` against `confkv.hf.generate` on SmolLM2, in process (no HTTP): the same
700-token prompt (pydoc-topics), 40 greedy tokens, memory 0.25, prefill chunk 256, one torch thread.
Prints the CPU and wall seconds of each and whether the tokens are equal (results/serve/README.md).

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 15 python benchmarks/serve_overhead.py
"""
import time, threading, torch
torch.set_num_threads(1)
from confkv.models import load_model
from confkv.data.corpora import corpus_tokens
from confkv.hf import ConfKVCache, generate
from confkv.config import StoreConfig
from confkv.serve.app import Server
from confkv.serve.engine import Job
model, tok = load_model("smollm2")
ids = corpus_tokens(tok, "pydoc-topics", 700, offset=5000)[0].tolist()
N = 40
def cache():
    return ConfKVCache.for_model(model, None, memory=0.25, store=StoreConfig(prefill_chunk=256), trace_limit=8)
c0, w0 = time.process_time(), time.perf_counter()
out = generate(model, torch.tensor([ids]), cache(), chunk=256, max_new_tokens=N, do_sample=False, eos_token_id=None)
c1, w1 = time.process_time(), time.perf_counter()
ref = out[0, len(ids):].tolist()
print(f"generate: cpu {c1-c0:.1f} s wall {w1-w0:.1f} s, {len(ref)} tokens", flush=True)
server = Server(model, tok, memory=0.25, chunk=256, max_batch=4)
engine = server.engine.start()
done = threading.Event(); got = []
def emit(kind, payload):
    if kind == "token": got.append(payload)
    else: done.set()
c0, w0 = time.process_time(), time.perf_counter()
engine.submit(Job(prompt=ids, cache=cache(), max_tokens=N, emit=emit, ignore_eos=True))
done.wait()
c1, w1 = time.process_time(), time.perf_counter()
print(f"engine:   cpu {c1-c0:.1f} s wall {w1-w0:.1f} s, {len(got)} tokens; equal to generate: {got == ref}", flush=True)
engine.stop()
