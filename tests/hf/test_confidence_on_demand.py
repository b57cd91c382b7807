"""The model's confidence is worked out only at steps that use it, or when the cache is asked to record it.

Users: the paper's budget gate (``confkv``, ``confkv-l``, ...), a ladder stepping pages down by
``"confidence"``, and ``record_confidence=True`` (the evaluation commands that report it). The memory
preset's step uses none of them: its trace holds NaN, and NaN logits are still warned of.
"""

from __future__ import annotations

import math
import warnings

import torch

from confkv.confidence import confidence as formula
from confkv.hf import ConfKVCache
from confkv.models import tiny_model


def _ids(length: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 250, (batch, length), generator=torch.Generator().manual_seed(3))


def _run(cache: ConfKVCache, model, ids: torch.Tensor) -> None:
    with torch.no_grad():
        for t in range(ids.shape[1]):
            model(ids[:, t:t + 1], cache=cache, use_cache=True)


def _count_confidence_calls(monkeypatch) -> list[int]:
    """Wrap the cache's confidence function; the list grows by one per call."""
    import confkv.hf.cache as cache_module

    calls: list[int] = []
    real = formula

    def counted(logits, config=None):
        calls.append(1)
        return real(logits, config)

    monkeypatch.setattr(cache_module, "confidence_of", counted)
    return calls


def test_the_preset_works_no_confidence_out_and_records_nan(monkeypatch):
    model = tiny_model("llama", seed=2)
    calls = _count_confidence_calls(monkeypatch)
    cache = ConfKVCache.for_model(model, memory=0.25)
    _run(cache, model, _ids(40, batch=2))
    assert calls == []
    assert len(cache.trace) == 40
    assert all(math.isnan(c) for c in cache.trace.confidences(1))
    assert cache.trace.to_dict()["confidence"][-1] == [None, None]  # JSON without NaN tokens


def test_record_confidence_records_what_the_formula_gives(monkeypatch):
    model = tiny_model("llama", seed=2)
    calls = _count_confidence_calls(monkeypatch)
    ids = _ids(12, batch=2)
    cache = ConfKVCache.for_model(model, memory=0.25, record_confidence=True)
    last_logits = []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            last_logits.append(model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    assert len(calls) == 12
    expected = formula(last_logits[-1])
    assert torch.equal(cache.trace.steps[-1].confidence, expected)
    assert all(0.0 < c <= 1.0 for c in cache.trace.confidences(0))


def test_a_fork_keeps_record_confidence():
    from confkv.policies import make_policy
    from confkv.policies.tee import TeePolicy

    model = tiny_model("llama", seed=2)
    tee = TeePolicy.of([make_policy("window", budget=8, protect=2), make_policy("h2o", budget=8, protect=2)])
    cache = ConfKVCache.for_model(model, tee, record_confidence=True)
    cache.evict = False
    with torch.no_grad():
        model(_ids(20), cache=cache, use_cache=True)
    twin = cache.fork(1)
    assert twin.record_confidence is True
    assert ConfKVCache.for_model(model, tee).fork(0).record_confidence is False


def test_the_paper_gate_still_works_confidence_out_without_being_asked(monkeypatch):
    model = tiny_model("llama", seed=2)
    calls = _count_confidence_calls(monkeypatch)
    cache = ConfKVCache.for_model(model, "confkv", n_high=8, n_low=16, protect=2, sinks=1, tau=0.5)
    _run(cache, model, _ids(10))
    assert len(calls) == 10
    assert not any(math.isnan(c) for c in cache.trace.confidences(0))


def test_a_ladder_stepping_down_by_confidence_gets_it(monkeypatch):
    model = tiny_model("llama", seed=2)
    calls = _count_confidence_calls(monkeypatch)
    cache = ConfKVCache.for_model(model, memory=0.25, step_down_by="confidence")
    _run(cache, model, _ids(10))
    assert len(calls) == 10
    assert not any(math.isnan(c) for c in cache.trace.confidences(0))


def test_pages_stepped_down_by_confidence_carry_the_confidence_of_a_step_of_their_own_sequence():
    """Each page on every rung holds the confidence the model had at a step of its sequence (the step it was sealed
    at), not the 0.5 a tier starts with: the order of stepping down is read from it."""
    from confkv.tiers.ladder import LadderTier

    model = tiny_model("llama", seed=2)
    cache = ConfKVCache.for_model(model, memory=0.25, step_down_by="confidence")
    _run(cache, model, _ids(300, batch=2))
    pages = 0
    for layer in cache.layers:
        store = layer.store
        if not isinstance(store.cold, LadderTier):
            continue
        for rung in store.cold.rungs:
            for b in range(2):
                seen = set(cache.trace.confidences(b))
                held = rung.pages["confidence"][b, :, :rung.num_pages].flatten().tolist()
                pages += len(held)
                assert set(held) <= seen, (sorted(set(held) - seen)[:3], b)
    assert pages > 0
    assert 0.5 not in set(cache.trace.confidences(0)) | set(cache.trace.confidences(1))


def test_nan_logits_are_warned_of_when_confidence_is_not_worked_out():
    model = tiny_model("llama", seed=2)

    def hook(module, inputs, output):
        output = output.clone()
        output[1] = float("nan")
        return output

    cache = ConfKVCache.for_model(model, memory=0.25)
    handle = model.get_output_embeddings().register_forward_hook(hook, prepend=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run(cache, model, _ids(3, batch=2))
    finally:
        handle.remove()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert sum("NaN logits in 1 sequence(s); the model's output is not a number" in m for m in messages) == 3, messages


def test_a_trace_without_confidence_writes_json_null_and_reads_back():
    """NaN (not worked out) is written as JSON null, not the non-standard NaN token, and read back as NaN."""
    import json

    from confkv.eval.report.plots import trace_from_dict

    model = tiny_model("llama", seed=2)
    cache = ConfKVCache.for_model(model, memory=0.25)
    _run(cache, model, _ids(5))
    text = json.dumps(cache.trace.to_dict(), allow_nan=False)  # raises on a NaN token
    again = trace_from_dict(json.loads(text))
    assert len(again) == 5 and all(math.isnan(c) for c in again.confidences(0))
