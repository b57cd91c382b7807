"""Moved to :mod:`confkv.tiers.page_file` (issue 33); this path stays for one release."""

from confkv._moved import alias

alias(__name__, "confkv.tiers.page_file")
