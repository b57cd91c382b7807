"""Moved to :mod:`confkv.cli.demo` (issue 33); this path stays for one release."""

from confkv._moved import alias

alias(__name__, "confkv.cli.demo")
