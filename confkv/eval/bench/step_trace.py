"""Which of the package's files one decode step enters, in the order it first enters them.

``python -m confkv.eval.bench.step_trace`` runs a tiny Llama under the memory preset (``memory=0.25``)
until the bit ladder holds pages, then profiles one more decode step (``model(token, cache=cache)``,
the step transformers' ``generate`` takes) and prints each ``confkv/`` file the step calls into,
with how many calls it made there. docs/ARCHITECTURE.md walks the same list by hand;
tests/project/test_architecture_doc.py keeps the two equal.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch

PACKAGE_MARK = "/confkv/"


def files_of_one_decode_step(prompt_tokens: int = 400, warm_steps: int = 30, memory: float = 0.25,
                             **storage) -> list[tuple[str, int]]:
    """[(file relative to the package, calls)] in first-entry order, for one decode step of the preset
    (``storage``: settings of the preset's storage to try instead, e.g. ``open_bits=8``)."""
    from confkv.hf import ConfKVCache, prefill  # noqa: PLC0415
    from confkv.models import tiny_model  # noqa: PLC0415

    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, memory=memory, **storage)
    ids = torch.randint(0, 250, (1, prompt_tokens + warm_steps + 1), generator=torch.Generator().manual_seed(0))
    prefill(model, cache, ids[:, :prompt_tokens], chunk=64)
    with torch.no_grad():
        for t in range(prompt_tokens, prompt_tokens + warm_steps):
            model(ids[:, t:t + 1], cache=cache)
        calls: Counter[str] = Counter()

        def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
            if event == "call" and PACKAGE_MARK in frame.f_code.co_filename:
                calls[frame.f_code.co_filename.rsplit(PACKAGE_MARK, 1)[1]] += 1

        last = prompt_tokens + warm_steps
        sys.setprofile(profile)
        try:
            model(ids[:, last:last + 1], cache=cache)
        finally:
            sys.setprofile(None)
    return list(calls.items())  # a Counter keeps first-insertion order


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    files = files_of_one_decode_step()
    for name, count in files:
        print(f"{count:5d}  confkv/{name}")
    print(f"{len(files)} files")


if __name__ == "__main__":
    main()
