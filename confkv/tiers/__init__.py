"""Storage apart from ranking: the memory target and the storage settings (:mod:`~confkv.tiers.storage`),
each step's plan (:mod:`~confkv.tiers.planner`), the cold tier (:mod:`~confkv.tiers.cold`, its read
:mod:`~confkv.tiers.cold_read`, the page codec :mod:`~confkv.tiers.lowbit`, the page file
:mod:`~confkv.tiers.page_file`), its bit ladder (:mod:`~confkv.tiers.ladder`), the page formats of its
low-bit pages (:mod:`~confkv.tiers.formats`) and the one byte model they share
(:mod:`~confkv.tiers.byte_model`). Plain tensors; no transformers import."""
