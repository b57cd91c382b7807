"""Who closes a cache's step (issue 33, "an explicit step"): confkv's own loops by hand, the model's
forward hook after passes they do not drive; the store reaches the attention call on its keys, not
through state outside the call."""

import threading

import pytest
import torch

from confkv.confidence import confidence as confidence_of
from confkv.hf import ConfKVCache, disable, enable, enabled, prefill
from confkv.hf.enable import confkv_attention, keys_for_attention
from confkv.hf.lean import LeanDecoder
from confkv.models import tiny_model


def _ids(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 250, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_each_forward_closes_the_step_of_the_cache_it_ran_with():
    model = tiny_model("llama")
    first = ConfKVCache.for_model(model, "full")
    second = ConfKVCache.for_model(model, "full")
    model(_ids(5), cache=first)
    model(_ids(3, seed=1), cache=second)
    model(_ids(1, seed=2), cache=first)
    assert (len(first.trace), len(second.trace)) == (2, 1)
    assert [s.seen for s in first.trace.steps] == [5, 6]
    assert [s.seen for s in second.trace.steps] == [3]


def test_the_step_gets_the_logits_the_model_returned_once_capped():
    """Gemma's final soft-cap is applied once (by the model): the recorded confidence is that of the model's output."""
    model = tiny_model("gemma3", final_logit_softcapping=0.5)
    cache = ConfKVCache.for_model(model, "full")
    out = model(_ids(6), cache=cache)
    expected = confidence_of(out.logits[:, -1], cache.confidence_config)
    torch.testing.assert_close(cache.trace.steps[-1].confidence, expected, rtol=0, atol=0)
    raw = confidence_of(torch.tanh(out.logits[:, -1] / 0.5) * 0.5, cache.confidence_config)
    assert not torch.equal(raw, expected)  # capping twice would be seen


def test_prefill_closes_its_own_steps_one_per_chunk():
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, "full")
    logits = prefill(model, cache, _ids(10), chunk=4)
    assert [s.seen for s in cache.trace.steps] == [4, 8, 10]
    assert not cache.closes_own_steps and not cache.pass_open
    torch.testing.assert_close(cache.trace.steps[-1].confidence, confidence_of(logits, cache.confidence_config),
                               rtol=0, atol=0)


def test_inside_steps_by_hand_the_hook_stays_out_until_the_caller_ends_the_step():
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, "full")
    with cache.steps_by_hand():
        out = model(_ids(4), cache=cache)
        assert len(cache.trace) == 0 and cache.pass_open
        cache.end_step(out.logits[:, -1])
    assert len(cache.trace) == 1 and not cache.pass_open
    model(_ids(1, seed=3), cache=cache)  # outside: the hook closes it again
    assert len(cache.trace) == 2


def test_the_lean_decoder_closes_its_own_step():
    model = tiny_model("llama")
    lean, cache = LeanDecoder(model), ConfKVCache.for_model(model, "full")
    lean(_ids(5), cache)
    lean(_ids(1, seed=4), cache)
    assert [s.seen for s in cache.trace.steps] == [5, 6]


def test_caches_in_two_threads_on_one_model_each_close_their_own_steps():
    model = tiny_model("llama")
    caches = [ConfKVCache.for_model(model, "full") for _ in range(2)]
    errors: list[BaseException] = []

    def run(cache: ConfKVCache, seed: int) -> None:
        try:
            for step in range(6):
                model(_ids(3 if step == 0 else 1, seed=seed + step), cache=cache)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(c, 10 * i)) for i, c in enumerate(caches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for cache in caches:
        assert [s.seen for s in cache.trace.steps] == [3, 4, 5, 6, 7, 8]


def test_disable_removes_the_hook_and_restores_the_attention():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    with enabled(model):
        assert model.config._attn_implementation == "confkv" and len(model._forward_hooks) == 1
        cache = ConfKVCache.for_model(model, "full")  # enabling again inside adds no second hook
        assert len(model._forward_hooks) == 1
        model(_ids(4), cache=cache)
    assert model.config._attn_implementation == before and not model._forward_hooks
    assert len(cache.trace) == 1
    enable(model)
    enable(model)
    assert len(model._forward_hooks) == 1
    disable(model)
    assert not model._forward_hooks


def test_the_store_travels_on_the_keys_and_plain_keys_fall_back_to_exact_attention():
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, "full")
    with cache.steps_by_hand():
        model(_ids(4), cache=cache)
    store = cache.layers[0].store
    keys = keys_for_attention(store)
    assert keys.confkv_store is store and keys is not store.recent.keys
    assert keys.data_ptr() == store.recent.keys.data_ptr()
    query = torch.randn(1, 4, 1, keys.shape[-1])
    values = store.recent.values
    plain = keys.clone()  # the same numbers without a store: SDPA over them
    out_plain, _ = confkv_attention(model.model.layers[0].self_attn, query, plain, values, None,
                                                   scaling=0.25)
    group = query.shape[1] // plain.shape[1]
    expected = torch.softmax(query @ plain.repeat_interleave(group, 1).transpose(-1, -2) * 0.25, -1) \
        @ values.repeat_interleave(group, 1)
    torch.testing.assert_close(out_plain, expected.transpose(1, 2))


def test_a_cache_the_model_never_reads_is_reported_not_closed_silently():
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, "full")
    model.set_attn_implementation("sdpa")  # the cache's keys are never read by confkv attention
    with pytest.raises(Exception, match="attn_implementation='confkv'"):
        model(_ids(4), cache=cache)
