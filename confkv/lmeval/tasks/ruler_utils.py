"""Datasets and scoring of confkv's offline RULER tasks for ``lm_eval --include_path`` (see README.md here).

Samples come from :func:`confkv.eval.ruler.tasks.make_ruler_sample` (generated locally,
deterministic); scores are RULER's (:mod:`confkv.eval.ruler.score`), reported per length
under the metric named by the length (``"4096"``, ``"8192"``), as lm-eval's ``ruler`` does.

Metadata (``--metadata '{...}'``, merged with ``--model_args``): ``max_seq_lengths`` (default
[4096]), ``num_samples`` (default 50), ``seed`` (default 0), and the tokenizer: ``tokenizer``,
else ``pretrained``, else ``model`` (a confkv model name, e.g. ``smollm2``; the confkv backend's
already-loaded tokenizer is reused).
"""

from __future__ import annotations

from typing import Any

import datasets

from confkv.eval.ruler.score import ruler_score
from confkv.eval.ruler.tasks import TASKS, make_ruler_sample

LENGTH_METRICS = (4096, 8192)


def _tokenizer(kwargs: dict[str, Any]) -> Any:
    from confkv.lmeval.backend import LOADED_TOKENIZERS, load_named_model

    name = kwargs.get("tokenizer") or kwargs.get("pretrained") or kwargs.get("model")
    if not name:
        raise ValueError("confkv RULER tasks size every sample with the model's tokenizer: give "
                         "--model_args model=<name> (or --metadata '{\"tokenizer\": \"<name>\"}')")
    if name in LOADED_TOKENIZERS:
        return LOADED_TOKENIZERS[name]
    from confkv.models import bundled_model_name

    if bundled_model_name(name) is not None or name.startswith("tiny-"):
        return load_named_model(name)[1]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def dataset(task: str, **kwargs: Any) -> dict[str, datasets.Dataset]:
    tokenizer = _tokenizer(kwargs)
    lengths = kwargs.get("max_seq_lengths", [4096])
    rows = []
    for length in lengths:
        for index in range(int(kwargs.get("num_samples", 50))):
            s = make_ruler_sample(task, tokenizer, int(length), index, seed=int(kwargs.get("seed", 0)))
            rows.append({"input": s.input, "gen_prefix": s.gen_prefix, "outputs": s.outputs, "max_length": s.length,
                         "metric": s.metric, "max_gen_toks": s.max_new_tokens})
    return {"test": datasets.Dataset.from_list(rows)}


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    scores = {str(length): -1.0 for length in LENGTH_METRICS}
    scores[str(doc["max_length"])] = ruler_score(results[0], doc["outputs"], doc["metric"])
    return scores


def aggregate(values: list[float]) -> float:
    kept = [v for v in values if v != -1]
    return sum(kept) / len(kept) if kept else -1


def _make(task: str):
    def build(**kwargs: Any) -> dict[str, datasets.Dataset]:
        return dataset(task, **kwargs)
    build.__name__ = task
    return build


for _task in TASKS:
    globals()[_task] = _make(_task)
