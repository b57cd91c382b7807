"""Fail-fast checks for where results are written (before any model is loaded or run).

A run that computes for an hour and then cannot write its result loses the hour; the
commands call :func:`check_writable` on every output path first.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from confkv.errors import ConfKVError


class OutputPathError(ConfKVError, OSError):
    """An output file or folder cannot be written; the message names the path and the fix."""


def check_writable(path: str | os.PathLike[str], *, folder: bool = False, what: str = "output") -> Path:
    """Make sure ``path`` (a file, or a folder with ``folder=True``) can be written.

    Creates the missing folders (they would be created by the write anyway) and writes
    and removes a probe file in the target folder. Returns ``path`` as a ``Path``.

    Raises:
        OutputPathError: a parent is a regular file, the folder cannot be created or
            written (permissions, read-only file system, full disk), or a file is
            expected where a folder is (or the reverse).
    """
    path = Path(path)
    target = path if folder else path.parent
    if not folder and path.is_dir():
        raise OutputPathError(f"{what} {path} is a folder, but a file name is expected here; "
                              f"pass a file path such as {path / 'result.json'}")
    if folder and path.exists() and not path.is_dir():
        raise OutputPathError(f"{what} folder {path} exists and is a file, not a folder; pass another folder")
    for parent in (target, *target.parents):
        if parent.exists():
            if not parent.is_dir():
                raise OutputPathError(f"cannot write {what} {path}: {parent} is a file, not a folder; "
                                      f"pass a path in a writable folder")
            break
    try:
        target.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".confkv-write-check-", dir=target)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise OutputPathError(f"cannot write {what} {path}: folder {target} is not writable "
                              f"({err.strerror or err}); pass a path in a writable folder") from err
    return path
