"""A prefill then one ``model(...)`` step per token, as the cache tests stream a text (:func:`decode_logits`), the
same stream read natively and by torch (:func:`native_and_torch_reads`), and whether two caches hold the same state
(:func:`same_cache_state`)."""

from __future__ import annotations

import torch

from confkv import profiling
from confkv.config import StoreConfig
from confkv.hf import ConfKVCache, prefill
from confkv.tiers.ladder import LadderTier


def decode_logits(model, cache, ids: torch.Tensor, prompt: int, chunk: int) -> torch.Tensor:
    """Prefill ``ids[:, :prompt]`` into ``cache`` in chunks of ``chunk``, then step ``model`` one token at a time
    through the rest of ``ids`` [B, T]; returns each step's last logits, [T - prompt, B, V]."""
    logits = []
    with torch.no_grad():
        prefill(model, cache, ids[:, :prompt], chunk=chunk)
        for t in range(prompt, ids.shape[1]):
            logits.append(model(ids[:, t:t + 1], cache=cache).logits[:, -1])
    return torch.stack(logits)


def native_and_torch_reads(model, ids: torch.Tensor, prompt: int, **cache_args) -> tuple[dict, dict, dict]:
    """Stream ``ids`` [1, T] through two caches ``ConfKVCache.for_model(model, **cache_args)`` whose reads are the
    default (``"auto"``: the native read where it applies) and ``"torch"``: a forward pass over ``ids[:, :prompt]``,
    then one step a token, the steps profiled. Returns, by backend, the steps' last logits [T - prompt, V], the
    reads that left the native path (:attr:`confkv.profiling.Timers.fallbacks`) and the cache."""
    logits, fallbacks, caches = {}, {}, {}
    for backend in ("auto", "torch"):
        cache = ConfKVCache.for_model(model, store=StoreConfig(read_backend=backend), **cache_args)
        timers = profiling.Timers()
        with torch.no_grad():
            model(ids[:, :prompt], cache=cache, use_cache=True)
            with profiling.enabled(timers):
                logits[backend] = torch.stack([model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1]
                                               for t in range(prompt, ids.shape[1])])
        fallbacks[backend], caches[backend] = dict(timers.fallbacks), cache
    return logits, fallbacks, caches


def _cold_tensors(cold) -> dict[str, torch.Tensor]:
    rungs = cold.rungs if isinstance(cold, LadderTier) else [cold]
    out = {}
    for number, rung in enumerate(rungs):
        for name, tensor in rung.pages.items():
            out[f"{number}.{name}"] = tensor.narrow(2, 0, rung.num_pages)
        for name, tensor in (rung.open or {}).items():
            out[f"{number}.open.{name}"] = tensor
    return out


def same_cache_state(a, b) -> None:
    """Every layer of caches ``a`` and ``b`` holds the same tokens, statistics (bit for bit), pages and bytes."""
    for layer_a, layer_b in zip(a.layers, b.layers):
        x, y = layer_a.store, layer_b.store
        for region in ("old", "recent"):
            ra, rb = getattr(x, region), getattr(y, region)
            for name in ("keys", "values", "positions", "valid"):
                assert torch.equal(getattr(ra, name), getattr(rb, name)), (region, name)
            assert ra.stats.keys() == rb.stats.keys()
            for name in ra.stats:  # bit for bit, NaN included
                assert torch.equal(ra.stats[name].view(torch.int32), rb.stats[name].view(torch.int32)), (region, name)
        ca, cb = _cold_tensors(x.cold), _cold_tensors(y.cold)
        assert ca.keys() == cb.keys()
        for name in ca:
            assert ca[name].shape == cb[name].shape and torch.equal(ca[name], cb[name]), name
        assert x.kv_bytes() == y.kv_bytes()
