"""Where models come from, one job per file.

- :mod:`~confkv.models.loading`: ``load_model(name)``: a bundled model, a local
  ``save_pretrained`` directory, a local ``.gguf`` file, or a Hugging Face hub id.
- :mod:`~confkv.models.bundled`: the models whose GGUF weights install from the package
  registry (``"smollm2"``, ``"gemma3-270m"``, ``"qwen2.5-coder-1.5b"``) and their aliases.
- :mod:`~confkv.models.part_packages`: a GGUF file split over numbered packages, found
  without importing them, joined and checked against a pinned size and SHA-256.
- :mod:`~confkv.models.model_cache`: the converted copy of a bundled GGUF (converted once,
  written atomically, validated and rebuilt when damaged).
- :mod:`~confkv.models.files`: reading a model directory or a ``.gguf`` file with transformers.
- :mod:`~confkv.models.tiny`: tiny random models of every supported architecture and a
  byte-level tokenizer, for the tests.
"""

from confkv.errors import ModelLoadError
from confkv.models.bundled import BUNDLED_MODELS, bundled_model_name
from confkv.models.loading import load_model, model_max_positions
from confkv.models.model_cache import CACHE_ENV_VAR, cache_root
from confkv.models.tiny import SUPPORTED_TINY_ARCHS, TINY_VOCAB_SIZE, tiny_model, tiny_tokenizer

__all__ = [
    "BUNDLED_MODELS",
    "CACHE_ENV_VAR",
    "ModelLoadError",
    "SUPPORTED_TINY_ARCHS",
    "TINY_VOCAB_SIZE",
    "bundled_model_name",
    "cache_root",
    "load_model",
    "model_max_positions",
    "tiny_model",
    "tiny_tokenizer",
]
