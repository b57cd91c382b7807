"""A/B of the KIVI page codec in C (``confkv.native.page_encode``, stop 63) in a prefill under a memory target: the
same random tokens prefilled into a fresh cache with the codec on and off, in turn, ``--repeats`` times; prints each
variant's median prefill and their ratio. Under a target a prefill seals pages and steps them down the ladder in
every chunk, so the codec's share is larger there than in a decode step (``benchmarks/store_step_ab.py --off
page_codec``).

    OMP_NUM_THREADS=1 python benchmarks/prefill_codec_ab.py 4096 --threads 1 --param open_bits=8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from preset_step_profile import add_setting_arguments, setting_of, torch_codec  # noqa: E402

from confkv.hf import ConfKVCache, prefill  # noqa: E402
from confkv.models import load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", type=int, help="prefill length")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--memory", type=float, default=0.25)
    add_setting_arguments(parser)
    args = parser.parse_args()
    policy, storage, setting = setting_of(args)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=torch.bfloat16)
    ids = torch.randint(1, 30000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for name in ("off", "on"):
            with torch_codec() if name == "off" else nullcontext(), torch.no_grad():
                cache = ConfKVCache.for_model(model, policy, memory=args.memory, **storage)
                began = time.perf_counter()
                prefill(model, cache, ids, chunk=args.chunk)
                seconds[name].append(time.perf_counter() - began)
    off, on = (statistics.median(seconds[k]) for k in ("off", "on"))
    print(f"{args.model}, {setting} (memory={args.memory}), bf16, {args.tokens} tokens prefilled in chunks of "
          f"{args.chunk}, {args.threads} thread(s), {args.repeats} interleaved repeats")
    print(f"median prefill s: codec off {off:.2f}; on {on:.2f}; off / on {off / on:.3f}x "
          f"(off {', '.join(f'{s:.2f}' for s in seconds['off'])}; on {', '.join(f'{s:.2f}' for s in seconds['on'])})")


if __name__ == "__main__":
    main()
