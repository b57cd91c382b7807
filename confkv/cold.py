"""Moved to :mod:`confkv.tiers.cold` (issue 33); this path stays for one release."""

from confkv._moved import alias

alias(__name__, "confkv.tiers.cold")
