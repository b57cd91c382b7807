"""Where the memory preset's lean decode step spends its Python: cProfile over decode steps of the preset
(``memory=0.25``) through the lean decoder with INT8 weights (W8A8), after a prefill of ``N`` random tokens.
Prints the call count and the functions with the most own time.

    .venv/bin/python benchmarks/preset_step_profile.py 1024 [smollm2|qwen2.5-coder-1.5b] [--steps 10] \
        [--policy tiered-int8] [--param open_bits=8]
"""
import argparse
import cProfile
import pstats
from contextlib import contextmanager

import torch

from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LeanDecoder
from confkv.hf.weights import quantize_linear_weights
from confkv.models import load_model
from confkv.native import page_encode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", type=int)
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sort", default="tottime", help="pstats order: tottime, cumtime, ...")
    parser.add_argument("--top", type=int, default=30)
    add_setting_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    policy, storage, label = setting_of(args)
    print(f"{label}, {args.tokens} tokens, {args.steps} steps, {args.threads} thread(s)")
    decoder, cache, ids, position = prefilled_preset(args.model, args.tokens, args.steps, warm=5, policy=policy,
                                                     **storage)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        decoder(ids[:, position:position + 1], cache)
        position += 1
    profile.disable()
    pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """``--policy`` and ``--param KEY=INT``: a cache other than the preset, for the benchmarks that build one."""
    parser.add_argument("--policy", default=None, help="a preset other than the default (e.g. tiered-int8)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=INT",
                        help="a storage setting of the cache, repeatable (e.g. open_bits=8)")


def setting_of(args: argparse.Namespace) -> tuple[str | None, dict[str, int], str]:
    """(policy, storage settings, a label for the printout) from :func:`add_setting_arguments`' arguments."""
    storage = {key: int(value) for key, value in (item.split("=", 1) for item in args.param)}
    return args.policy, storage, " ".join(filter(None, [args.policy, *args.param])) or "the preset"


@contextmanager
def torch_codec():
    """The KIVI page codec's C calls off (``confkv.native.page_encode``; the torch code runs) inside the block."""
    codec = page_encode.encode_kivi, page_encode.decode_kivi
    page_encode.encode_kivi = page_encode.decode_kivi = lambda *args: None
    try:
        yield
    finally:
        page_encode.encode_kivi, page_encode.decode_kivi = codec


def prefilled_preset(model_name: str, tokens: int, steps: int, warm: int, policy: str | None = None, **storage):
    """The preset (``memory=0.25``; or ``policy``, and ``storage`` settings such as ``open_bits=8``) of
    ``model_name`` in bf16 with W8A8 weights, prefilled with ``tokens`` random tokens and stepped ``warm`` times
    through the lean decoder: (decoder, cache, ids [1, tokens + warm + steps + 1], the next position)."""
    model, _ = load_model(model_name, dtype=torch.bfloat16)
    quantize_linear_weights(model, activation_bits=8)
    ids = torch.randint(1, 30000, (1, tokens + warm + steps + 1), generator=torch.Generator().manual_seed(0))
    cache = ConfKVCache.for_model(model, policy, memory=0.25, **storage)
    with torch.no_grad():
        prefill(model, cache, ids[:, :tokens], chunk=512)
    decoder = LeanDecoder(model)
    for position in range(tokens, tokens + warm):  # unmeasured
        decoder(ids[:, position:position + 1], cache)
    return decoder, cache, ids, tokens + warm


if __name__ == "__main__":
    main()
