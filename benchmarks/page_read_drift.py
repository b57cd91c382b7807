"""How far the native page read's output and masses drift from the torch block-wise read, inside a real run.

Wraps the native page read's C call (``confkv.native.pages._read``, under :func:`~confkv.native.page_entry.page_read` and
the stores' ``PageReader`` alike) so that every read it serves is also run by
:func:`confkv.attention.blockwise_attention` on the densified segments, then runs a ``confkv`` command
unchanged and prints the number of reads and the largest absolute differences (output, masses).
The run itself goes on with the native read's result. Usage (results/memory/README.md)::

    .venv/bin/python benchmarks/page_read_drift.py ppl --model smollm2 --dtype bfloat16 --threads 1 \\
        --tokens 860 --no-progress --corpus pydoc-topics --policy tiered --memory 0.125
"""

from __future__ import annotations

import atexit
import sys

from confkv.attention import DEFAULT_BLOCK_SIZE, blockwise_attention
from confkv.attention.segments import densify
from confkv.native import pages

_native_read = pages._read
_seen = {"reads": 0, "output": 0.0, "mass": 0.0}


def _checked_read(lib, query, segments, scaling, need_mass, rotation):
    out = _native_read(lib, query, segments, scaling, need_mass, rotation)
    reference, reference_mass = blockwise_attention(query, densify(list(segments)), scaling, DEFAULT_BLOCK_SIZE,
                                                        need_mass=need_mass)
    _seen["reads"] += 1
    _seen["output"] = max(_seen["output"], (out[0].float() - reference.float()).abs().max().item())
    if need_mass and out[1] is not None:
        for mass, expected in zip(out[1], reference_mass):
            if mass.numel():
                _seen["mass"] = max(_seen["mass"], (mass.float() - expected.float()).abs().max().item())
    return out


def _report() -> None:
    print(f"native page reads {_seen['reads']}: largest |output - torch| {_seen['output']:.3g}, "
          f"largest |mass - torch| {_seen['mass']:.3g}")


if __name__ == "__main__":
    pages._read = _checked_read  # page_read and PageReader call it through the module
    atexit.register(_report)
    from confkv.cli.main import main

    sys.exit(main(sys.argv[1:]))
