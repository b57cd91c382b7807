"""The Hadamard rotation's seed (``ColdConfig.rotation_seed``): checked, carried to the pages, read back with them.

Hand bugs each test was seen to fail with: the format building its rotation at seed 0 whatever it is given; the
check letting ``True`` through as a seed; the torch read folding seed 0's rotation into the query while the pages
hold another seed's codes (a ``shared_rotation(head_dim)`` in ``ColdTier.read_rotation``: caught by the logits with
the native kernels off, where the read folds it; the native read takes the pages with their own rotation attached);
the ladder not passing the storage's seed to its rungs; the preset signature naming the seed at 0.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from confkv.config import ColdConfig
from confkv.errors import ConfigError
from confkv.native import loader
from confkv.tiers.formats import format_for
from confkv.tiers.hadamard import shared_rotation


@pytest.mark.parametrize("seed", [-1, 1.5, True, "3", 2 ** 63])
def test_a_bad_seed_is_a_config_error_naming_the_field(seed):
    with pytest.raises(ConfigError, match="rotation_seed"):
        ColdConfig(format="hadamard", rotation_seed=seed)


def test_the_seed_reaches_the_policy_and_the_pages_rotation():
    from confkv.policies import make_policy

    policy = make_policy("kivi", bits=3, format="hadamard+outliers+clip", rotation_seed=5)
    assert policy.cold.rotation_seed == 5
    fmt = format_for(policy.cold, 32, torch.bfloat16)
    assert fmt.rotation is shared_rotation(32, 5)
    assert not torch.equal(fmt.rotation.signs, shared_rotation(32, 0).signs)  # another rotation, not seed 0's
    assert format_for(ColdConfig(bits=3, format="hadamard"), 32, torch.bfloat16).rotation is shared_rotation(32, 0)


def _logits(seed: int | None, fold: bool = True) -> tuple[torch.Tensor, object]:
    """Prefill 40 tokens of a tiny fp32 Llama and decode 8, every page read each step (None: DynamicCache)."""
    from transformers import DynamicCache

    from confkv.hf import ConfKVCache
    from confkv.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama").float()
    cache = (DynamicCache(config=model.config) if seed is None else
             ConfKVCache.for_model(model, "kivi", bits=8, format="hadamard", page_size=8, group_size=8, budget=8,
                                   rotation_seed=seed))
    if seed is not None:
        for layer in cache.layers:
            layer.store.cold.fold_rotation = fold
    ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = [model(input_ids=ids[:, :40], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(40, 48):
            logits.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.cat(logits), cache


@pytest.mark.parametrize("native", [True, False], ids=["native-read", "torch-read"])
def test_pages_of_another_seed_are_read_in_their_own_rotation(native):
    """8-bit rotated pages at seed 11 give the logits of full precision (within the 8-bit codes' error), read with
    the rotation folded into the query or decoded back alike; their stored codes are not seed 0's."""
    with contextlib.nullcontext() if native else loader.disabled():
        reference, _ = _logits(None)
        seeded, cache = _logits(11)
        unfolded, _ = _logits(11, fold=False)
        _, seed0 = _logits(0)
    tier = cache.layers[0].store.cold
    assert tier.num_pages >= 3 and tier.read_rotation() is shared_rotation(tier.format.head_dim, 11)
    scale = reference.abs().max()
    assert (seeded - reference).abs().max() <= 0.02 * scale
    assert (seeded - unfolded).abs().max() <= 1e-5 * scale
    codes = [c.layers[0].store.cold.pages["value_codes"] for c in (cache, seed0)]
    assert not torch.equal(*codes)


def test_a_ladder_s_rungs_share_the_storage_s_seed_and_a_preset_s_signature_names_it_only_off_zero(monkeypatch):
    """Every rung of a ``Storage(rotation_seed=S)`` ladder rotates by seed S's one shared rotation (so a read folds
    one rotation); the preset's signature, which keys its results, is as recorded at seed 0 and changes off it."""
    import dataclasses

    from confkv import presets
    from confkv.tiers.ladder import LadderTier
    from confkv.tiers.storage import Storage

    ladder = LadderTier(Storage(ladder=(8, 4, 3), format="hadamard", rotation_seed=3))
    formats = [format_for(rung.config, 32, torch.float32) for rung in ladder.rungs]  # as each rung builds its own
    assert [fmt.bits for fmt in formats] == [8, 4, 3]
    assert all(fmt.rotation is shared_rotation(32, 3) for fmt in formats)
    with pytest.raises(ConfigError, match="rotation_seed"):
        Storage(format="hadamard", rotation_seed=-2)
    signature = presets.preset_signature("tiered")
    assert "rotation_seed" not in signature
    tiered = presets.PRESETS["tiered"]
    monkeypatch.setitem(presets.PRESETS, "tiered", dataclasses.replace(
        tiered, storage=dataclasses.replace(tiered.storage, rotation_seed=4)))
    assert "rotation_seed=4" in presets.preset_signature("tiered")
