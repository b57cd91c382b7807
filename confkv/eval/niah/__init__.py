"""Needle in a haystack: a grid of context lengths x depths x trials, two protocols.

One job per file:

- :mod:`~confkv.eval.niah.config`: :class:`NiahConfig`, the protocol names and versions,
  grid entries (``"confkv+int8"``);
- :mod:`~confkv.eval.niah.budgets`: each policy's parameters under the grid's memory target;
- :mod:`~confkv.eval.niah.protocols`: the ``query-aware`` and ``streaming`` protocols
  (one batch of same-length samples);
- :mod:`~confkv.eval.niah.runner`: the whole grid (shared prefills, ``full`` once, resuming
  from ``niah.jsonl``);
- :mod:`~confkv.eval.niah.records`: records, accuracies and summary lines, ``niah.json``/``niah.csv``;
- :mod:`~confkv.eval.niah.heatmap`: the heatmap plot.
"""

from confkv.data import DEFAULT_NEEDLE_TEMPLATE, DEFAULT_QUESTION_TEMPLATE
from confkv.eval.niah.budgets import full_kv_bytes, memory_params
from confkv.eval.niah.config import PROTOCOL_VERSIONS, PROTOCOLS, NiahConfig, parse_spec
from confkv.eval.niah.heatmap import plot_niah
from confkv.eval.niah.protocols import run_niah_batch, run_query_aware_shared
from confkv.eval.niah.records import NiahRecord, NiahResult, load_records, record_key, write_niah
from confkv.eval.niah.runner import check_niah_positions, run_key, run_niah_grid

__all__ = ["DEFAULT_NEEDLE_TEMPLATE", "DEFAULT_QUESTION_TEMPLATE", "NiahConfig", "NiahRecord", "NiahResult",
           "PROTOCOL_VERSIONS", "check_niah_positions", "load_records", "parse_spec", "record_key", "run_key",
           "run_query_aware_shared", "PROTOCOLS", "memory_params", "full_kv_bytes", "plot_niah",
           "run_niah_batch", "run_niah_grid", "write_niah"]
