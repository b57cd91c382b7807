"""Storage apart from ranking (ARCHITECTURE.md): the memory target, the storage settings, the cold tier's
bit ladder, the page formats of its low-bit pages (:mod:`confkv.tiers.formats`) and the one byte model
they share. Plain tensors; no transformers import."""
