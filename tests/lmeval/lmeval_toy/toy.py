"""A toy lm-eval task set defined locally (no download): a generation task and a multiple-choice task."""

from __future__ import annotations

import datasets

PROMPTS = ["The cat sat on the", "One two three four", "Hello there, general", "abc abc abc abc abc abc"]


def gen_dataset(**kwargs):
    rows = [{"prompt": p * (1 + i), "answer": "x"} for i, p in enumerate(PROMPTS)]
    return {"test": datasets.Dataset.from_list(rows)}


def mc_dataset(**kwargs):
    rows = [{"prompt": p * (1 + i), "choices": [" mat", " five", " Kenobi", " abc"], "label": i}
            for i, p in enumerate(PROMPTS)]
    return {"test": datasets.Dataset.from_list(rows)}


def process_gen(doc, results):
    return {"answered": float(len(results[0]) >= 0)}
