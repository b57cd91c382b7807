"""No import circles inside the package (issue 33, "A house a newcomer can live in").

The test reads every module of ``confkv/`` with :mod:`ast` (nothing is imported) and builds the
graph "module A imports module B". Choices, written down:

* **Every import statement counts**, at module level and inside functions and methods alike: an
  import moved into a function still ties the two modules together, and hiding one there to get
  round a circle is what this test is meant to stop.
* **Imports under ``if TYPE_CHECKING:`` do not count**: they never run, they only name types.
* ``from package import name`` is an edge to ``package.name`` when that is a module of ours,
  otherwise to ``package`` (its ``__init__``).
* Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so it is an edge to those
  packages too, except to the importer's own packages (they are already running when it runs).
* Only modules of the package are nodes; third-party and standard-library imports are ignored.

A circle is reported with its modules in order, e.g. ``confkv.x -> confkv.y -> confkv.x``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "confkv"


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file below ``root`` (a package is its ``__init__``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree``, at any depth, except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module docstring for what counts)."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                candidates = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                              for alias in node.names]
            for candidate in candidates:
                parts = candidate.split(".")
                targets.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
        own = {".".join(name.split(".")[:end]) for end in range(1, name.count(".") + 2)}
        targets = {target for target in targets if target in modules and target not in own}
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (as a path that returns to its start) for each strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm; the graph is a few hundred nodes deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_circle_in(graph, set(group)) for group in groups]


def _circle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle through the first module of a strongly connected ``group`` (breadth first)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle in {sorted(group)}")  # pragma: no cover - a group always has one


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles in confkv:\n" + "\n".join(" -> ".join(circle) for circle in found)


def test_the_walk_finds_a_circle(tmp_path):
    """The checker itself: a circle hidden in a function and one through ``from . import`` are found,
    one under ``if TYPE_CHECKING`` is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (package / "d.py").write_text("import pkg.c\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.c"] == set() and graph["pkg.d"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_a_package_init_is_part_of_the_circle(tmp_path):
    """``import pkg.sub.x`` runs ``pkg/sub/__init__.py`` first: a circle through it is found."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub.x import f\n")
    (package / "sub" / "x.py").write_text("from pkg import y\ndef f():\n    pass\n")
    (package / "y.py").write_text("from pkg.sub.z import g\n")
    (package / "sub" / "z.py").write_text("g = 1\n")
    graph = import_graph(package)
    assert graph["pkg.y"] == {"pkg.sub", "pkg.sub.z"}
    assert graph["pkg.sub.x"] == {"pkg.y"}  # its own packages pkg and pkg.sub are not edges
    assert cycles(graph) == [["pkg.sub", "pkg.sub.x", "pkg.y", "pkg.sub"]]
