"""Storage apart from ranking (ARCHITECTURE.md): the memory target, the storage settings, the cold tier's
bit ladder and the one byte model they share. Plain tensors; no transformers import."""
