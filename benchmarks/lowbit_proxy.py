"""A fast, teacher-forced stand-in for the streaming perplexity of a cold-page format (tuning only).

The streaming run (benchmarks/lowbit_ppl.py) feeds one token per step: minutes per run on one
thread. Under the KIVI policy (every token kept: an FP window of ``budget`` recent tokens,
every older token in sealed pages, all read) the keys a query sees depend only on which pages
were sealed by its step, so one causal forward pass can replay them: query ``i`` sees the
decoded page of key ``j`` when ``j``'s page of ``page_size`` tokens ended at least ``budget``
tokens before ``i`` (the store moves tokens in blocks and pages seal when full, so the real
run seals a little later: this is a slight over-count of the quantized keys), and the exact
key otherwise. Each layer's format is calibrated on its first page alone, as in the stream.

Numbers from here are a ranking for tuning; the tables in results/lowbit/ are streaming runs.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/lowbit_proxy.py --bits 3 --format kivi hadamard hadamard+codebook

Each cell prints one JSON line (model, text, widths, format, settings, proxy perplexity). With ``--out FILE`` the
lines are appended there as well and a cell already in the file is not run again, so a stopped grid goes on where
it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from confkv.tiers.formats import build_format

_STATE: dict = {}


def _sim_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    layer = module.layer_idx
    cfg = _STATE["config"]
    batch, q_heads, length, dim = query.shape
    heads = key.shape[1]
    page = cfg["page_size"]
    pages = length // page
    formats = _STATE["formats"]
    if layer not in formats:
        formats[layer] = build_format(cfg["bits"], cfg["group_size"], dim, key.dtype, cfg["format"],
                                      cfg["outlier_fraction"], rope=_STATE.get("rope"),
                                      value_bits=cfg.get("value_bits"))  # None: values at `bits` too
    fmt = formats[layer]
    k = key[:, :, :pages * page].reshape(batch, heads, pages, page, dim)
    v = value[:, :, :pages * page].reshape(batch, heads, pages, page, dim)
    valid = torch.ones(batch, heads, pages, page, dtype=torch.bool)
    positions = torch.arange(pages * page).reshape(1, 1, pages, page).expand(batch, heads, pages, page)
    fmt.encode(k[:, :, :1], v[:, :, :1], valid[:, :, :1], positions[:, :, :1])  # calibrate on the first page
    kq, vq = fmt.decode(fmt.encode(k, v, valid, positions), positions)
    kq = torch.cat([kq.reshape(batch, heads, pages * page, dim), key[:, :, pages * page:].float()], 2)
    vq = torch.cat([vq.reshape(batch, heads, pages * page, dim), value[:, :, pages * page:].float()], 2)
    group = q_heads // heads
    q = query.float()
    exact_k = key.float().repeat_interleave(group, 1)
    exact_v = value.float().repeat_interleave(group, 1)
    kq, vq = kq.repeat_interleave(group, 1), vq.repeat_interleave(group, 1)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    page_end = (j // page + 1) * page  # the position after j's page
    sealed = (page_end <= i - cfg["budget"]) & (j // page < pages) & (j >= cfg["sinks"])
    causal = j <= i
    s_exact = (q @ exact_k.transpose(-1, -2)) * scaling
    s_quant = (q @ kq.transpose(-1, -2)) * scaling
    scores = torch.where(sealed, s_quant, s_exact).masked_fill(~causal, float("-inf"))
    probs = scores.softmax(-1)
    out = (probs * ~sealed) @ exact_v + (probs * sealed) @ vq
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def proxy_ppl(model, ids, **config) -> float:
    from transformers import AttentionInterface

    AttentionInterface.register("lowbit_sim", _sim_attention)
    _STATE.update(config=config, formats={})
    model.set_attn_implementation("lowbit_sim")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    nll = torch.logsumexp(logits, -1) - logits.gather(-1, ids[0, 1:, None])[:, 0]
    return math.exp(float(nll.mean()))


CELL_FIELDS = ("model", "compute", "corpus", "tokens", "bits", "value_bits", "format", "outlier_fraction", "sinks",
               "group_size", "page_size", "budget")


def cell_key(record: dict) -> tuple:
    """What names a cell of the grid: records written before ``model``, ``tokens`` and ``page_size`` were
    recorded are SmolLM2's in bfloat16, 2,048 tokens, pages of 64; keys and values at one width unless
    ``value_bits``."""
    defaults = {"model": "smollm2", "compute": "bfloat16", "tokens": 2048, "page_size": 64,
                "value_bits": record.get("bits")}
    return tuple(record.get(name, defaults.get(name)) for name in CELL_FIELDS)


def done_cells(path: Path | None) -> set[tuple]:
    """The cells already in ``path`` (none when it is missing)."""
    if path is None or not path.exists():
        return set()
    return {cell_key(json.loads(line)) for line in path.read_text().splitlines() if line.strip()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", default="pydoc-topics")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--bits", type=int, nargs="+", default=[3])
    parser.add_argument("--value-bits", type=int, default=None,
                        help="values at this width, keys at --bits (default: values at --bits too)")
    parser.add_argument("--format", nargs="+", default=["kivi"])
    parser.add_argument("--outlier-fraction", type=float, nargs="+", default=[0.01])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--sinks", type=int, nargs="+", default=[0], help="first tokens kept exact (the policy's sinks)")
    parser.add_argument("--compute", choices=("bfloat16", "float32"), default="bfloat16",
                        help="float32: the bf16 model's weights (rounded to bf16 as loaded) computed in float32, for "
                             "CPUs whose bf16 GEMMs are far slower than float32's (AVX2 without bf16 units); the keys "
                             "and values are then float32")
    parser.add_argument("--out", type=Path, default=None,
                        help="append each cell's line to this .jsonl and skip the cells already there (resumable)")
    args = parser.parse_args()
    done = done_cells(args.out)
    torch.set_num_threads(1)
    from confkv.data import corpus_tokens
    from confkv.models import load_model

    from confkv.tiers.prerope import Rope

    model, tokenizer = load_model(args.model, dtype=torch.bfloat16)
    if args.compute == "float32":
        model = model.float()
    _STATE["rope"] = Rope.from_model(model)
    ids = corpus_tokens(tokenizer, args.corpus, args.tokens)
    config = model.config
    shape = {"kv_heads": config.num_key_value_heads,
             "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads}
    for bits in args.bits:
        for fmt in args.format:
            for fraction in args.outlier_fraction if "outliers" in fmt else [0.0]:
                for sinks in args.sinks:
                    widths = {"bits": bits} if args.value_bits in (None, bits) else {
                        "bits": bits, "value_bits": args.value_bits}
                    record = {"model": args.model, "compute": args.compute, "tokens": args.tokens, **widths,
                              "format": fmt, "outlier_fraction": fraction, "sinks": sinks,
                              "group_size": args.group_size, "page_size": args.page_size, "budget": args.budget,
                              "corpus": args.corpus}
                    if cell_key(record) in done:
                        continue
                    start = time.time()
                    ppl = proxy_ppl(model, ids, bits=bits, format=fmt, group_size=args.group_size, sinks=sinks,
                                    page_size=args.page_size, budget=args.budget, outlier_fraction=fraction,
                                    value_bits=args.value_bits)
                    record.update(shape, proxy_ppl=round(ppl, 4), seconds=round(time.time() - start, 1))
                    line = json.dumps(record)
                    print(line, flush=True)
                    if args.out is not None:
                        with args.out.open("a") as sink:
                            sink.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
