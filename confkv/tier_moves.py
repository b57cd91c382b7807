"""Moved to :mod:`confkv.store.tier_moves` (issue 33); this path stays for one release."""

from confkv._moved import alias

alias(__name__, "confkv.store.tier_moves")
