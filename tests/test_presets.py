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


def test_a_preset_s_storage_fields_come_as_lists_from_json_and_bad_ones_are_named():
    """A ladder read from JSON or the command line is a list and becomes the storage's tuple; a ladder that is not
    a sequence reaches the storage's own check, which names the field and the fix (not a TypeError from the
    conversion)."""
    import pytest

    from confkv.config import ConfigError

    spec = presets.resolve("tiered", memory=0.25, ladder=[8, 4])
    assert spec.storage.ladder == (8, 4)
    for bad in (4, None):
        with pytest.raises(ConfigError, match=r"ladder: must be a tuple of bit widths, e\.g\. \(8, 4, 3, 2\)"):
            presets.resolve("tiered", memory=0.25, ladder=bad)
