"""The README's Python examples run (issue 33): each ```python block is executed as written, with
``model`` a tiny random Llama (``confkv.models.tiny``) and ``input_ids`` / ``mask`` a short prompt,
the names a reader brings. Only the API is checked here, not a figure."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from confkv.models.tiny import tiny_model

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def test_the_readme_has_python_examples():
    assert len(python_blocks(README.read_text())) >= 2


@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text()))))
def test_a_readme_example_runs(index):
    block = python_blocks(README.read_text())[index]
    if "base_url=" in block:  # a client of a running `confkv serve`: compiled here, run by tests/serve/test_serve.py's client tests
        compile(block, f"README.md, python block {index + 1}", "exec")
        return
    model = tiny_model("llama")
    input_ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    namespace = {"model": model, "input_ids": input_ids, "mask": torch.ones_like(input_ids)}
    exec(compile(block, f"README.md, python block {index + 1}", "exec"), namespace)  # noqa: S102 - our own README
    if "out" in namespace:  # the generate example: it generated, and the cache counted its bytes
        assert namespace["out"].shape[1] > input_ids.shape[1]
        assert namespace["cache"].kv_bytes() > 0
