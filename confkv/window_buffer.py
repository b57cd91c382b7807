"""Moved to :mod:`confkv.store.window_buffer` (issue 33); this path stays for one release."""

from confkv._moved import alias

alias(__name__, "confkv.store.window_buffer")
