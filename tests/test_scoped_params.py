"""``--param <policy>:<key>=value``: a parameter for one policy of a grid, the others untouched."""

import pytest

from confkv.errors import ConfigError
from confkv.eval.niah.budgets import _policy_extra, budgets_for_bytes, check_scoped_params, full_kv_bytes
from confkv.eval.ruler import RulerConfig
from confkv.models import tiny_model


def test_a_scoped_key_goes_to_its_policy_only_and_wins():
    extra = {"budget": 64, "confkv_r:budget": 16, "confkv-r:bits": 4, "protect": 8}
    assert _policy_extra("confkv-r", extra) == {"budget": 16, "bits": 4, "protect": 8}
    assert _policy_extra("tova", extra) == {"budget": 64, "protect": 8}  # no bits, no scoped budget
    assert _policy_extra("window", {"confkv-r:bits": 4}) == {}


def test_a_scoped_key_of_a_policy_not_run_or_a_parameter_it_lacks_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"--param quest:k: 'quest' is not one of the policies run \(full, tova\)"):
        check_scoped_params({"quest:k": 2}, ["full", "tova"])
    with pytest.raises(ConfigError, match=r"--param tova:bits: tova has no parameter 'bits'"):
        check_scoped_params({"tova:bits": 4}, ["tova+int8"])
    check_scoped_params({"tova:budget": 4, "confkv_r:k": 2}, ["tova+int8", "confkv-r"])  # fine
    with pytest.raises(ConfigError, match="not one of the policies run"):
        RulerConfig(policies=("full", "tova"), extra_params={"confkv-r:budget": 256})


def test_a_grid_matches_each_policy_with_its_own_parameters():
    model = tiny_model("llama")
    extra = {"confkv-r:budget": 24, "confkv-r:bits": 4, "confkv-r:page_size": 8, "confkv-r:group_size": 8,
             "confkv-r:protect": 4, "confkv-r:k": 2}
    target = 0.25 * full_kv_bytes(model, 400)
    out = budgets_for_bytes(model, ["tova", "confkv-r"], target, 400, extra=extra)
    assert out["tova"] == {"budget": 100}  # a quarter of 400 tokens at full precision
    assert out["confkv-r"]["budget"] == 24 and out["confkv-r"]["bits"] == 4
    assert 100 - 24 < out["confkv-r"]["cold_budget"] < 400  # 4-bit pages: more tokens than the FP bytes buy


def test_the_model_dtype_is_part_of_a_grids_run_key():
    """A bfloat16 run never resumes into a float32 run's records (nor the other way round)."""
    from confkv.agent.grid import AgentConfig
    from confkv.agent.grid import run_key as agent_key
    from confkv.eval.ruler import run_key as ruler_key

    assert ruler_key(RulerConfig(), "smollm2") != ruler_key(RulerConfig(dtype="bfloat16"), "smollm2")
    assert '"dtype": "bfloat16"' in ruler_key(RulerConfig(dtype="bfloat16"), "smollm2")
    assert agent_key(AgentConfig(), "smollm2") != agent_key(AgentConfig(dtype="bfloat16"), "smollm2")
