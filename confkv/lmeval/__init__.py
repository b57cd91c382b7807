"""lm-evaluation-harness backend: ``import confkv.lmeval`` registers the model ``"confkv"``.

Needs the optional extra (``pip install "confkv[lmeval]"``, lm-eval 0.4.13). lm-eval 0.4.13
finds models only in its own registry (its built-in ``MODEL_MAPPING`` plus whatever module
called ``@register_model``), with no entry-point discovery, so the name ``confkv`` exists
once this package is imported:

- Python: ``import confkv.lmeval`` then ``lm_eval.simple_evaluate(model="confkv", model_args=...)``;
- command line: ``confkv-lm-eval`` (or ``python -m confkv.lmeval``) takes lm_eval's own arguments
  (``--model confkv --model_args model=smollm2,policy=tova,memory=0.25,int8=True --tasks ...``).
  The bare ``lm_eval`` command cannot see the name: 0.4.13 has no plugin discovery.

confkv's offline RULER tasks for ``--include_path`` (any backend): :func:`task_dir`
(``confkv_ruler_<task>``, tag ``confkv_ruler``; see ``tasks/ruler_utils.py``).
"""

from __future__ import annotations

from pathlib import Path

try:
    import lm_eval  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError("confkv.lmeval needs lm-evaluation-harness: pip install 'confkv[lmeval]' "
                      "(pins lm-eval==0.4.13)") from error

from confkv.lmeval.backend import ConfKVLM, load_named_model  # noqa: E402  (registers "confkv")



def task_dir() -> Path:
    """The folder of confkv's offline RULER task configs, for ``lm_eval --include_path``."""
    return Path(__file__).parent / "tasks"


__all__ = ["ConfKVLM", "load_named_model", "task_dir"]
