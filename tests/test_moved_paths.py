"""The modules that moved in issue 33 keep their old import paths for one release: the old path
gives the new module itself, so ``from old import name`` and monkeypatching both still work."""

import importlib
import subprocess
import sys
import warnings

import pytest

MOVED = {
    "confkv.commands_eval": "confkv.cli.evaluate",
    "confkv.commands_agent": "confkv.cli.agent",
    "confkv.commands_ppl": "confkv.cli.ppl",
    "confkv.commands_ruler": "confkv.cli.ruler",
    "confkv.demo": "confkv.cli.demo",
    "confkv.textplot": "confkv.cli.textplot",
    "confkv.region": "confkv.store.region",
    "confkv.window_buffer": "confkv.store.window_buffer",
    "confkv.tier_moves": "confkv.store.tier_moves",
    "confkv.cold": "confkv.tiers.cold",
    "confkv.lowbit": "confkv.tiers.lowbit",
    "confkv.page_file": "confkv.tiers.page_file",
}


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
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
