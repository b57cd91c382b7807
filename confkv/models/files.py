"""Reading a model from files: a ``save_pretrained`` directory or a ``.gguf`` file (transformers).

Used by :mod:`confkv.models.loading` (a path given by the user) and by
:mod:`confkv.models.model_cache` (converting a bundled GGUF once).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from confkv.errors import ModelLoadError


def _load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """Load (and dequantize) a GGUF file with transformers. Slow: ~20-60 s on 2 cores.

    Returns (model, tokenizer) with the GGUF quantizer detached so ``save_pretrained``
    writes plain full-precision safetensors.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for dep in ("gguf", "accelerate"):
        if importlib.util.find_spec(dep) is None:
            raise ModelLoadError(f"loading GGUF weights needs the '{dep}' package: pip install 'confkv[gguf]'")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except ModelLoadError:
        raise
    except Exception as err:  # gguf raises ValueError/struct errors/etc. on corrupt files
        raise ModelLoadError(f"could not read GGUF file {gguf_path} ({type(err).__name__}: {err})") from err
    # The weights are already dequantized to fp32; drop the quantizer so the model saves normally.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    return model, tokenizer



def _finish(model: Any, dtype: torch.dtype, device: str | torch.device) -> Any:
    model = model.to(device=device, dtype=dtype)
    model.eval()
    return model


def _from_directory(path: Path, dtype: torch.dtype, device: str | torch.device) -> tuple[Any, Any]:
    """Load model + tokenizer from a local ``save_pretrained`` directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a model directory: it has no config.json (expected a save_pretrained output)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as err:
        raise ModelLoadError(
            f"could not load the model in {path} ({type(err).__name__}: {err}); "
            "the weight files may be missing or corrupt - re-save or re-download them"
        ) from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:
        raise ModelLoadError(
            f"could not load a tokenizer from {path} ({type(err).__name__}: {err}); "
            "save one next to the model with tokenizer.save_pretrained(path)"
        ) from err
    return _finish(model, dtype, device), tokenizer


def _from_gguf_file(path: Path, dtype: torch.dtype, device: str | torch.device) -> tuple[Any, Any]:
    model, tokenizer = _load_gguf(path)
    return _finish(model, dtype, device), tokenizer


