"""Tiers of the KV store and the page formats of their low-bit pages (see :mod:`confkv.tiers.formats`)."""
