"""Moved to :mod:`confkv.tiers.lowbit` (issue 33); this path stays for one release."""

from confkv._moved import alias

alias(__name__, "confkv.tiers.lowbit")
