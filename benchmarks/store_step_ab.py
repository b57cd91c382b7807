"""A/B of the store's per-step Python work inside the memory preset's whole decode step (stop 59): one process, one
cache, stepped in interleaved blocks with this checkout's shortcuts on or off. Prints the median step of each and
their ratio.

The shortcuts, each of which leaves the store byte for byte as the path it short-cuts does (their tests say so):

* ``age_evict``: the steady state's ageing and eviction in one C call (``hot_tier.age_and_evict_at_once``); off, the
  store's ``_age`` and ``_evict`` run (the ranking's split still one C call, ``split_by_rank``);
* ``every_page``: a cold tier reading every page hands over the same packed segment, with the native read's
  pointers, while its pages do not change (``EveryPageRead``); off, both are made at every read;
* ``append_one``: a decode step's token appended and placed in fewer calls (``AttentionRead._append_one``); off,
  ``append`` then ``attend``;
* ``read_updates`` (stop 60): the native page read updates the hot regions' EMA and the cold pages' heat in place
  from its masses (``AttentionRead._updates_in_place``); off, ``policy.observe`` and ``cold.observe_read`` do;
* ``keep_pages`` (stop 60): a cold tier's pages dropped in one C call (``native.pages.keep_pages``); off, the gather;
* ``page_codec`` (stop 63): KIVI pages encoded (seals, step-downs) and decoded (step-downs) in one C call each
  (``native.page_encode``); off, the torch code.
* ``scores_in_c`` (stop 67): the one-call ageing's C call works out the EMA + recency scores itself
  (``hot_tier._age_split_scored``, ``confkv_age_evict_rows_ema``); off, torch scores the concatenated regions.
* ``step_down`` (stop 67): a ladder's step-down gathers its pages' tensors at one index with the rows worked out
  once (``gather_pages_of``) and grows a rung of exact capacity by one ``cat`` a tensor (``cold._joined_pages``);
  off, a gather a tensor and ``_grow`` then a copy.

``--off`` names the shortcuts the "off" variant turns off (default: all of them). The cache is the preset
(``memory=0.25``; ``--policy`` and ``--param open_bits=8`` for another setting) through the lean decoder with INT8
weights (W8A8), prefilled with ``N`` random tokens; both variants
step the same cache in turn. Wall clock; the ratio is the figure (the machine's load moves both alike).

    OMP_NUM_THREADS=2 python benchmarks/store_step_ab.py 8192 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from preset_step_profile import add_setting_arguments, prefilled_preset, setting_of  # noqa: E402

from confkv.attention.segments import gather_pages  # noqa: E402
from confkv.native import page_encode  # noqa: E402
from confkv.native import pages as native_pages  # noqa: E402
from confkv.store import hot_tier  # noqa: E402
from confkv.store.read import AttentionRead  # noqa: E402
from confkv.tiers import cold, cold_read  # noqa: E402
from confkv.tiers.cold_read import EveryPageRead  # noqa: E402

SHORTCUTS = ("age_evict", "every_page", "append_one", "read_updates", "keep_pages", "page_codec", "scores_in_c", "step_down")


def _two_calls(self, keys, values, query, *, scaling):
    """``decode_step`` without ``_append_one``: the in-place step where it applies, else append then attend."""
    if self.can_decode_in_place(keys, query):
        return self._decode_in_place(keys, values, query, scaling)
    self.append(keys, values)
    return self.attend(query, scaling=scaling)


def _gather_each(tensors: dict, index):
    """``gather_pages_of`` as a gather a tensor (what it replaced)."""
    return {name: gather_pages(tensor, index) for name, tensor in tensors.items()}


def switch(off: set[str]) -> dict:
    """Turn the shortcuts ``off`` off (module attributes replaced); returns what to put back."""
    saved = {"age_evict": (hot_tier, "age_and_evict_at_once", hot_tier.age_and_evict_at_once),
             "every_page": (EveryPageRead, "serves", EveryPageRead.serves),
             "append_one": (AttentionRead, "decode_step", AttentionRead.decode_step),
             "read_updates": (AttentionRead, "_updates_in_place", AttentionRead._updates_in_place),
             "keep_pages": (native_pages, "keep_pages", native_pages.keep_pages),
             "page_codec": (page_encode, "encode_kivi", page_encode.encode_kivi),
             "page_decode": (page_encode, "decode_kivi", page_encode.decode_kivi),
             "scores_in_c": (hot_tier, "_age_split_scored", hot_tier._age_split_scored),
             "step_down": (cold, "_joined_pages", cold._joined_pages),
             "gather_once": (cold, "gather_pages_of", cold.gather_pages_of),
             "gather_once_read": (cold_read, "gather_pages_of", cold_read.gather_pages_of)}
    replacement = {"age_evict": lambda store, budget: False, "every_page": lambda self, *args: False,
                   "append_one": _two_calls, "read_updates": lambda self, *args: None,
                   "keep_pages": lambda *args: None, "page_codec": lambda *args: None, "page_decode": lambda *args: None,
                   "scores_in_c": lambda *args: False, "step_down": lambda *args: None,
                   "gather_once": _gather_each, "gather_once_read": _gather_each}
    if "page_codec" in off:  # both halves of the codec (decode too)
        off = off | {"page_decode"}
    if "step_down" in off:  # the gathers too, in both modules that make them
        off = off | {"gather_once", "gather_once_read"}
    for name in off:
        owner, attribute, _ = saved[name]
        setattr(owner, attribute, replacement[name])
    return {name: saved[name] for name in off}


def restore(saved: dict) -> None:
    for owner, attribute, value in saved.values():
        setattr(owner, attribute, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", type=int, help="prefill length")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--off", nargs="+", choices=SHORTCUTS, default=list(SHORTCUTS))
    parser.add_argument("--blocks", type=int, default=8, help="blocks of steps per variant")
    parser.add_argument("--steps", type=int, default=6, help="steps a block (the first one of each block not timed)")
    add_setting_arguments(parser)
    args = parser.parse_args()
    policy, storage, setting = setting_of(args)
    torch.set_num_threads(args.threads)
    decoder, cache, ids, position = prefilled_preset(args.model, args.tokens, 2 * args.blocks * args.steps, warm=4,
                                                     policy=policy, **storage)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.blocks):
        for name in ("off", "on"):
            saved = switch(set(args.off) if name == "off" else set())
            for step in range(args.steps):
                began = time.perf_counter()
                decoder(ids[:, position:position + 1], cache)
                if step:  # the first step of a block takes the other variant's state over
                    times[name].append(1e3 * (time.perf_counter() - began))
                position += 1
            restore(saved)
    off, on = (statistics.median(times[k]) for k in ("off", "on"))
    print(f"{args.model}, {setting} (memory=0.25) through the lean decoder, W8A8, {args.tokens} tokens prefilled, "
          f"{args.threads} thread(s); {args.blocks} interleaved blocks of {args.steps - 1} timed steps each")
    print(f"median step ms: shortcuts off ({', '.join(args.off)}): {off:.2f}; on: {on:.2f}; off / on {off / on:.3f}x")
    off, on = (statistics.mean(times[k]) for k in ("off", "on"))  # steps that seal or step pages down count here
    print(f"mean step ms: off {off:.2f}; on: {on:.2f}; off / on {off / on:.3f}x")


if __name__ == "__main__":
    main()
