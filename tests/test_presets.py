"""Named presets (:mod:`confkv.presets`): the signature that keys their results."""

import dataclasses

from confkv import presets


def test_a_preset_s_signature_names_its_ranking_and_storage_and_changes_with_them(monkeypatch):
    tiered = presets.PRESETS["tiered"]
    signature = presets.preset_signature("tiered")
    assert signature is not None and signature.startswith(f"{tiered.policy} ") and repr(tiered.storage) in signature
    assert presets.preset_signature("h2o") is None  # a registry policy, not a preset
    changed = dataclasses.replace(tiered, storage=dataclasses.replace(tiered.storage, hot_share=0.3))
    monkeypatch.setitem(presets.PRESETS, "tiered", changed)
    assert presets.preset_signature("tiered") not in (None, signature)
