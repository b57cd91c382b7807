"""The converted-model cache: a bundled GGUF is dequantized once and saved as safetensors.

transformers dequantizes a GGUF file to full precision on load, which takes
20-60 s on two CPU cores. The first load therefore saves a converted copy
(safetensors + tokenizer) under the cache directory and later loads read that
copy (well under a second plus the tokenizer). The copy is fp32 unless the model's
``cache_dtype`` says otherwise (the 1.5B Qwen keeps bf16: half the disk and load
memory). The copy is written into a temporary directory and renamed into place, so an
interrupted conversion never leaves a half-written cache; a cache that fails
validation is rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from confkv.models.files import _load_gguf

if TYPE_CHECKING:
    from confkv.models.bundled import BundledModel

CACHE_ENV_VAR = "CONFKV_CACHE_DIR"
_CACHE_FORMAT = 1
_MARKER_FILE = "confkv_cache.json"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Root of the converted-model cache: ``cache_dir``, else ``$CONFKV_CACHE_DIR``,
    else ``~/.cache/confkv/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "confkv" / "models"


def _dir_listing(path: Path) -> dict[str, int]:
    """{file name: size in bytes} for the regular files directly inside ``path``."""
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file() and p.name != _MARKER_FILE}


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((path / _MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def cache_is_valid(path: Path, source_version: str | None, dtype: str = "float32") -> bool:
    """True when ``path`` holds a complete conversion of the installed source package.

    Checks the marker written last by the conversion, that every file it lists exists
    with the recorded size, that the weights were saved in ``dtype`` (markers without a
    dtype are float32), and (when the package is installed) that the package version
    matches. A missing package with a complete cache still counts as valid.
    """
    if not path.is_dir():
        return False
    marker = _read_marker(path)
    if marker is None or marker.get("format") != _CACHE_FORMAT:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return False
    if marker.get("dtype", "float32") != dtype:
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


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name kept in the marker)."""
    return str(dtype).removeprefix("torch.")


def discard(path: Path) -> None:
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


def convert_into_cache(spec: BundledModel, target: Path, source_version: str | None) -> None:
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
        model = model.to(spec.cache_dtype)
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
            "dtype": dtype_name(spec.cache_dtype),
            "files": _dir_listing(tmp),
        }
        # The marker is written last: a directory without it is never trusted.
        (tmp / _MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True))
        if cache_is_valid(target, source_version, dtype_name(spec.cache_dtype)):
            return  # another process finished first; keep its copy
        discard(target)
        try:
            os.replace(tmp, target)
        except OSError:
            # Lost a race: another process renamed its copy into place between our
            # discard and our rename. Its copy is as good as ours.
            if not cache_is_valid(target, source_version, dtype_name(spec.cache_dtype)):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

