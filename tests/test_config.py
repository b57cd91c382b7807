import pytest

from confkv import ConfigError, GateConfig, StoreConfig, make_policy
from confkv.hf import ConfKVCache
from confkv.models import tiny_model


@pytest.mark.parametrize("params, field", [
    ({"tau": 1.5}, "tau"),
    ({"tau": -0.1}, "tau"),
    ({"n_high": 600, "n_low": 512}, "n_high"),
    ({"n_high": 0}, "n_high"),
    ({"protect": 256, "n_high": 256}, "protect"),
    ({"protect": 300, "n_high": 256}, "protect"),
    ({"protect": 250, "sinks": 10, "n_high": 256}, "sinks"),
    ({"ema_decay": 1.0}, "ema_decay"),
    ({"w_margin": -1.0}, "w_margin"),
    ({"w_entropy": 0, "w_margin": 0, "w_top": 0}, "w_entropy"),
    ({"bogus": 3}, "bogus"),
])
def test_bad_confkv_params_raise_value_error_naming_field(params, field):
    with pytest.raises(ValueError, match=field):
        make_policy("confkv", **params)


def test_unknown_policy_lists_known_ones():
    with pytest.raises(ConfigError, match="known policies: .*confkv.*window"):
        make_policy("nope")


@pytest.mark.parametrize("kwargs, field", [
    ({"fp_window": -1}, "fp_window"), ({"prefill_chunk": 0}, "prefill_chunk"),
    ({"block_size": 0}, "block_size"), ({"kv_int8": "yes"}, "kv_int8"), ({"move_block": 0}, "move_block"),
])
def test_bad_store_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StoreConfig(**kwargs)


def test_fp_window_must_fit_the_budget():
    with pytest.raises(ConfigError, match="fp_window"):
        ConfKVCache.for_model(tiny_model("llama"), "confkv", n_high=100, n_low=200,
                              store=StoreConfig(kv_int8=True, fp_window=128))


def test_gate_defaults_are_valid():
    gate = GateConfig()
    assert gate.n_high < gate.n_low and 0 <= gate.tau <= 1


def test_reading_every_cold_page_is_spelled_all():
    from confkv.config import ALL_PAGES, ColdConfig
    from confkv.policies import make_policy

    every = ColdConfig(k_high="all", k_low="all", cold_budget=64)  # "all" is never more than cold_budget holds
    assert (every.k_high, every.k_low, every.needs_digest) == (ALL_PAGES, ALL_PAGES, False)
    assert ColdConfig(k_high="all").needs_digest  # k_low still reads a few pages: digests needed
    assert make_policy("confkv-r", k="all").cold == make_policy("confkv-r", k=ALL_PAGES).cold
    with pytest.raises(ConfigError, match=r'k_low.*or "all"'):
        ColdConfig(k_low="every")
