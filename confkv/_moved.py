"""Old import paths of modules that moved (issue 33): each old path gives the new module itself, for one release.

Two mechanisms, both without copies of a module (attributes and monkeypatching agree):

- :data:`MOVED`: an old module (or package prefix) whose name is free now. A finder at the front of
  ``sys.meta_path`` answers ``import old`` with the new module (a ``DeprecationWarning`` says where it
  went) and ``python -m old`` by running the new module as ``__main__``.
- :func:`old_module_names`: an old *module* whose name is now a package of the same name
  (``confkv.eval.bench``, ``confkv.eval.ruler``, ``confkv.eval.report``): the package's ``__getattr__``
  hands out the old module's names from the module they live in now.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any, Callable

#: old dotted name (a module, or a package together with everything under it) -> its new name
MOVED: dict[str, str] = {
    "confkv.commands_eval": "confkv.cli.evaluate",
    "confkv.commands_agent": "confkv.cli.agent",
    "confkv.commands_ppl": "confkv.cli.ppl",
    "confkv.commands_ruler": "confkv.cli.ruler",
    "confkv.demo": "confkv.cli.demo",
    "confkv.textplot": "confkv.cli.textplot",
    "confkv.region": "confkv.store.hot_tier",
    "confkv.window_buffer": "confkv.store.window_buffer",
    "confkv.tier_moves": "confkv.store.hot_tier",
    "confkv.store.tier_moves": "confkv.store.hot_tier",
    "confkv.eviction": "confkv.store.hot_tier",
    "confkv.cold": "confkv.tiers.cold",
    "confkv.lowbit": "confkv.tiers.lowbit",
    "confkv.page_file": "confkv.tiers.page_file",
    "confkv.attention.paged": "confkv.attention.segments",
    "confkv.agent": "confkv.eval.agent",
    "confkv.eval.ppl": "confkv.eval.quality.ppl",
    "confkv.eval.sweep": "confkv.eval.quality.sweep",
    "confkv.eval.probe": "confkv.eval.quality.probe",
    "confkv.eval.guard": "confkv.eval.quality.guard",
    "confkv.eval.int8_quality": "confkv.eval.quality.int8",
    "confkv.eval.stream": "confkv.eval.quality.stream",
    "confkv.eval.streaming_crosscheck": "confkv.eval.quality.streaming_crosscheck",
    "confkv.eval.policy_table": "confkv.eval.quality.policy_table",
    "confkv.eval.soak": "confkv.eval.quality.soak",
    "confkv.eval.bench_attention": "confkv.eval.bench.attention",
    "confkv.eval.bench_dtypes": "confkv.eval.bench.dtypes",
    "confkv.eval.bench_llamacpp": "confkv.eval.bench.llamacpp",
    "confkv.eval.bench_loops": "confkv.eval.bench.loops",
    "confkv.eval.bench_machine": "confkv.eval.bench.machine",
    "confkv.eval.bench_native_step": "confkv.eval.bench.native_step",
    "confkv.eval.bench_output": "confkv.eval.bench.output",
    "confkv.eval.llamacpp_worker": "confkv.eval.bench.llamacpp_worker",
    "confkv.eval.serve_load": "confkv.eval.bench.serve_load",
    "confkv.eval.ruler_score": "confkv.eval.ruler.score",
    "confkv.eval.ruler_tasks": "confkv.eval.ruler.tasks",
    "confkv.eval.ray_grid": "confkv.eval.ray.grid",
    "confkv.eval.ray_speedup": "confkv.eval.ray.speedup",
    "confkv.eval.plots": "confkv.eval.report.plots",
    "confkv.serve.command": "confkv.cli.serve",
    "confkv.hf.attention": "confkv.hf.enable",
    "confkv.store.region": "confkv.store.hot_tier",
    "confkv.store.eviction": "confkv.store.hot_tier",
    "confkv.trace": "confkv.tiers.planner",
}


def new_name(old: str) -> str | None:
    """The new dotted name of ``old`` (or of a module under an old package), or None if it did not move."""
    for prefix, target in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix):]
    return None


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release", DeprecationWarning, stacklevel=4)


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of :data:`MOVED`'s old names with the new modules."""

    def find_spec(self, name: str, path: Any = None, target: Any = None):  # noqa: ANN201 - importlib's protocol
        new = new_name(name)
        if new is None:
            return None
        found = importlib.util.find_spec(new)
        return importlib.util.spec_from_loader(name, self, origin=found.origin,
                                               is_package=found.submodule_search_locations is not None)

    def create_module(self, spec):  # noqa: ANN001, ANN201
        new = new_name(spec.name)
        _warn(spec.name, new)
        return importlib.import_module(new)  # the module itself: importlib keeps its own name and spec

    def exec_module(self, module) -> None:  # noqa: ANN001 - already executed under its new name
        return None

    def get_code(self, name: str):  # noqa: ANN201 - what ``python -m old`` runs: the new module's code
        new = new_name(name)
        _warn(name, new)
        return importlib.util.find_spec(new).loader.get_code(new)


def install() -> None:
    """Put the old-path finder at the front of ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())


def old_module_names(package: str, module: str, names: tuple[str, ...]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``package`` that gives ``names`` (the old module ``package``'s names) from ``module``."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warnings.warn(f"{package}.{name} moved to {module}.{name}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), name)

    return __getattr__
