"""Moved to :mod:`confkv.cli.evaluate` (issue 33); this path stays for one release."""

from confkv._moved import alias

alias(__name__, "confkv.cli.evaluate")
