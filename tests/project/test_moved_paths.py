"""The modules that moved in issue 33 keep their old import paths for one release: the old path
gives the new module itself, so ``from old import name`` and monkeypatching both still work."""

import importlib
import subprocess
import sys
import warnings

import pytest

from confkv._moved import MOVED

#: a module under each moved package, reached through the old package's path
UNDER_MOVED_PACKAGES = {"confkv.agent.world": "confkv.eval.agent.world",
                        "confkv.agent.sites.shop": "confkv.eval.agent.sites.shop"}


@pytest.mark.parametrize("old, new", sorted({**MOVED, **UNDER_MOVED_PACKAGES}.items()))
def test_an_old_path_is_the_new_module(old, new):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert importlib.import_module(old) is importlib.import_module(new)


def test_public_names_keep_their_old_paths():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from confkv.commands_eval import MEMORY_HELP, COMMANDS, parse_params
        from confkv.commands_ruler import run_ruler
        from confkv.demo import run_demo
        from confkv.textplot import sparkline
    from confkv.cli.common import MEMORY_HELP as common_help, parse_params as common_parse

    assert MEMORY_HELP is common_help and parse_params is common_parse
    assert callable(run_ruler) and callable(run_demo) and "niah" in COMMANDS
    assert sparkline([0.0, 1.0], width=2)


def test_the_console_entry_point_and_python_m_still_work():
    from confkv.cli import main

    assert callable(main)
    done = subprocess.run([sys.executable, "-m", "confkv.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage: confkv" in done.stdout


def test_the_store_s_old_functions_still_run():
    """``store_fork.fork_store`` and ``store_decode``'s check and step are methods now; the old functions call them."""
    import torch

    from confkv.config import StoreConfig
    from confkv.policies import make_policy
    from confkv.store import LayerStore
    from confkv.store_decode import decode_in_place, decodes_in_place
    from confkv.store_fork import fork_store

    stores = [LayerStore(make_policy("h2o", budget=8, protect=2), StoreConfig(move_block=1)) for _ in range(2)]
    for store in stores:  # the same prefill in both
        gen = torch.Generator().manual_seed(0)
        store.append(torch.randn(1, 2, 3, 4, generator=gen), torch.randn(1, 2, 3, 4, generator=gen))
        store.attend(torch.randn(1, 4, 3, 4, generator=gen), scaling=0.5)
        store.end_step(torch.full((1,), 8, dtype=torch.int64))
    keys, values, query = (torch.randn(1, 2, 1, 4, generator=gen), torch.randn(1, 2, 1, 4, generator=gen),
                           torch.randn(1, 4, 1, 4, generator=gen))
    old, new = stores
    assert decodes_in_place(old, keys, query) == new.can_decode_in_place(keys, query)
    if decodes_in_place(old, keys, query):
        assert torch.equal(decode_in_place(old, keys, values, query, 0.5),
                           new.decode_step(keys, values, query, scaling=0.5))
    twin = fork_store(old, make_policy("h2o", budget=8, protect=2))
    assert twin is not old and twin.kept_list() == old.kept_list()


def test_an_old_path_warns_where_the_module_went():
    for name in [n for n in sys.modules if n == "confkv.eval.plots"]:
        del sys.modules[name]
    with pytest.warns(DeprecationWarning, match="confkv.eval.plots moved to confkv.eval.report.plots"):
        importlib.import_module("confkv.eval.plots")


def test_the_old_modules_now_packages_still_give_their_names():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from confkv.eval.bench import run_bench
        from confkv.eval.report import build_report
        from confkv.eval.ruler import RulerConfig
    from confkv.eval.bench.run import run_bench as new_run_bench
    from confkv.eval.report.page import build_report as new_build_report
    from confkv.eval.ruler.grid import RulerConfig as NewRulerConfig

    assert (run_bench, build_report, RulerConfig) == (new_run_bench, new_build_report, NewRulerConfig)
    import confkv.eval.ruler

    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        confkv.eval.ruler.nothing_here  # noqa: B018


def test_python_m_on_an_old_path_runs_the_new_module():
    done = subprocess.run([sys.executable, "-W", "default::DeprecationWarning", "-m", "confkv.eval.stream", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "max-kv-bytes" in done.stdout and "moved to confkv.eval.quality.stream" in done.stderr
