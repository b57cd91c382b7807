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
