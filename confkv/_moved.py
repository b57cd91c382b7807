"""Old import paths of modules that moved (issue 33): each old module is the new one, for one release."""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make ``import old`` give module ``new`` itself (same object: attributes and monkeypatching agree)."""
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release", DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
