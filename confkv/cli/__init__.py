"""The ``confkv`` command line: one module per group of subcommands, and what they share.

* :mod:`confkv.cli.main`: the parser and ``main`` (the ``confkv`` console script, ``python -m confkv.cli``);
* :mod:`confkv.cli.common`: argument types, help texts, removed flags, ``--param`` parsing;
* :mod:`confkv.cli.demo`, :mod:`confkv.cli.ppl`, :mod:`confkv.cli.evaluate` (niah, probe, sweep, report),
  :mod:`confkv.cli.agent`, :mod:`confkv.cli.ruler`: the subcommands, thin over :mod:`confkv.eval`;
* :mod:`confkv.cli.textplot`: the terminal sparkline.

Importing this package loads no model code: each subcommand imports what it runs.
"""

from confkv.cli.main import main

__all__ = ["main"]
