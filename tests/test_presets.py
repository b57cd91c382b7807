"""Named presets (:mod:`confkv.presets`): the signature that keys their results."""

import dataclasses

from confkv import presets


def test_a_preset_s_signature_names_its_ranking_and_storage_and_changes_with_them(monkeypatch):
    tiered = presets.PRESETS["tiered"]
    signature = presets.preset_signature("tiered")
    assert signature is not None and signature.startswith(f"{tiered.policy} ") and "format='kivi+hadamard'" in signature
    assert presets.preset_signature("h2o") is None  # a registry policy, not a preset
    changed = dataclasses.replace(tiered, storage=dataclasses.replace(tiered.storage, hot_share=0.3))
    monkeypatch.setitem(presets.PRESETS, "tiered", changed)
    assert presets.preset_signature("tiered") not in (None, signature)


def test_a_field_added_later_at_its_old_behaviour_leaves_the_signature_as_recorded(monkeypatch):
    """The signature the preset's NIAH records carry from before ``unread_by`` existed (results/qwen/niah,
    3 Dec): unchanged while ``unread_by`` is "age", changed when it is not."""
    recorded = ("confkv-fixed [] Storage(ladder=(8, 4, 3), hot_share=0.2, hot_tokens=None, page_size=64, "
                "group_size=64, step_down_by='heat', step_order='error', format='kivi+hadamard', "
                "outlier_fraction=0.01, seal_early=True, offload=False, offload_dir=None)")
    assert presets.preset_signature("tiered") == recorded
    tiered = presets.PRESETS["tiered"]
    monkeypatch.setitem(presets.PRESETS, "tiered", dataclasses.replace(
        tiered, storage=dataclasses.replace(tiered.storage, unread_by="attention")))
    assert "unread_by='attention'" in presets.preset_signature("tiered")
