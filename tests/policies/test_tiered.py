"""A tiered policy refuses a ``cold`` that is not a ColdConfig, naming the field and what it got.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

from __future__ import annotations

import pytest

from confkv.errors import ConfigError
from confkv.policies.kivi import KIVIPolicy


def test_cold_must_be_a_cold_config_and_the_error_says_so():
    with pytest.raises(ConfigError, match=r"^cold: must be a ColdConfig, got str$"):
        KIVIPolicy(cold="x")
    with pytest.raises(ConfigError, match=r"^cold: must be a ColdConfig, got dict$"):
        KIVIPolicy(cold={"bits": 4})
