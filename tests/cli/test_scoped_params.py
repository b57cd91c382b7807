"""``--param <policy>:<key>=value``: a parameter for one policy of a grid, the others untouched."""

import pytest

from confkv.errors import ConfigError
from confkv.eval.niah.budgets import _policy_extra, check_scoped_params, memory_params
from confkv.eval.ruler.grid import RulerConfig
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


def test_a_grid_gives_each_policy_its_own_parameters_under_the_target():
    """Scoped keys reach their policy, storage fields their preset, and the cache built from them holds them."""
    from confkv.hf import ConfKVCache

    model = tiny_model("llama")
    extra = {"protect": 4, "tova:protect": 6, "tiered:ladder": [8, 4], "tiered:page_size": 8,
             "tiered:group_size": 8, "kivi_2:hot_tokens": 8}
    assert memory_params("tova", 0.25, extra) == {"protect": 6, "memory": 0.25}
    tiered = memory_params("tiered", 0.25, extra)
    assert tiered == {"protect": 4, "ladder": [8, 4], "page_size": 8, "group_size": 8, "memory": 0.25}
    cache = ConfKVCache.for_model(model, "tiered", **tiered)
    assert cache.storage.ladder == (8, 4) and cache.storage.page_size == 8 and cache.policy.protect == 4
    assert cache.target.memory == 0.25
    assert ConfKVCache.for_model(model, "kivi-2", **memory_params("kivi-2", 0.25, extra)).storage.hot_tokens == 8
    with pytest.raises(ConfigError, match="ladder"):
        memory_params("tiered", 0.25, {"tiered:ladder": [8, 5]})
    with pytest.raises(ConfigError, match=r"--param tova:ladder: tova has no parameter 'ladder'"):
        check_scoped_params({"tova:ladder": [8]}, ["tova", "tiered"])


def test_the_model_dtype_is_part_of_a_grids_run_key():
    """A bfloat16 run never resumes into a float32 run's records (nor the other way round)."""
    from confkv.eval.agent.grid import AgentConfig
    from confkv.eval.agent.grid import run_key as agent_key
    from confkv.eval.ruler.grid import run_key as ruler_key

    assert ruler_key(RulerConfig(), "smollm2") != ruler_key(RulerConfig(dtype="bfloat16"), "smollm2")
    assert '"dtype": "bfloat16"' in ruler_key(RulerConfig(dtype="bfloat16"), "smollm2")
    assert agent_key(AgentConfig(), "smollm2") != agent_key(AgentConfig(dtype="bfloat16"), "smollm2")


def test_a_policy_gets_only_the_parameters_it_takes_and_the_named_policy_is_checked():
    """Unscoped keys that a policy does not take are left out for it (``bits`` is KIVI's, not TOVA's); the
    check under the target is of the policy named, not of the default preset (a policy with its own cold
    tier is refused by name); a key with two colons names the policy before the first one."""
    from confkv.policies.registry import accepted_parameters

    assert _policy_extra("tova", {"bits": 3, "budget": 4}) == {"budget": 4}
    assert memory_params("h2o", 0.25, {"bits": 3}) == {"memory": 0.25}
    with pytest.raises(ConfigError, match=r"^confkv-r at memory 0.25: storage: policy 'confkv-r' brings its own"):
        memory_params("confkv-r", 0.25, None)
    takes = ", ".join(sorted(accepted_parameters("tova")))
    with pytest.raises(ConfigError) as refused:
        memory_params("tova", 0.25, {"tova:ladder:x": 1})
    assert str(refused.value) == f"--param tova:ladder:x: tova has no parameter 'ladder:x'; it takes {takes}"
    with pytest.raises(ConfigError, match=r"^--param tova:ladder:x: tova has no parameter 'ladder:x'"):
        check_scoped_params({"tova:ladder:x": 1}, ["tova"])
    check_scoped_params({"tova:protect": 2}, ["tova+int8+slack64"])  # a spec's policy: before its first "+"
