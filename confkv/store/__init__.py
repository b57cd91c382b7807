"""The KV store of one attention layer (:class:`LayerStore`), by job:

* :mod:`confkv.store.layer`: the store's state, what it keeps at the end of a step (ageing the FP
  window, INT8, eviction, promotion), its bytes, batch reorders and ``fork``;
* :mod:`confkv.store.read`: the attention read of a step (``attend``, ``decode_step`` in place);
* :mod:`confkv.store.hot_tier`: the hot tier: a run of KV slots (``Region``: the older region, the FP window),
  the split of the slots a step keeps from the others (one C call in the common cases, ageing included), and the
  others handed to the cold tier (and back);
* :mod:`confkv.store.selection`: which slots a step keeps, the rule every policy's eviction follows (tensor functions);
* :mod:`confkv.store.window_buffer`: the FP window's slots with spare capacity.
"""

from confkv.store.layer import LayerStore, check_store_fits

__all__ = ["LayerStore", "check_store_fits"]
