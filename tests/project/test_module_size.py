"""No module of the package passes 400 lines (issue 33; docs/LAYOUT.md, "One job per file").

A module that grows past the limit is split by job (a package that re-exports its public names,
or a class's halves in two modules, each saying what it does), not cut at line 400.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "confkv"
LIMIT = 400


def too_long(root: Path = PACKAGE, limit: int = LIMIT) -> dict[str, int]:
    """Module path (relative to the repository) -> its line count, for every ``.py`` file over ``limit``."""
    counts = {path: len(path.read_text().splitlines()) for path in sorted(root.rglob("*.py"))}
    return {str(path.relative_to(root.parent)): count for path, count in counts.items() if count > limit}


def test_no_module_is_over_400_lines():
    found = too_long()
    assert not found, f"modules over {LIMIT} lines (split them by job): {found}"


def test_the_check_counts_lines(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * 4)
    assert too_long(tmp_path / "pkg", limit=3) == {"pkg/long.py": 4}
