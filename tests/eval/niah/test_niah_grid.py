"""NIAH grid: both protocols run, are scored, and are exact with the full cache; heatmap written."""

import pytest
import torch

from confkv.data import make_niah_sample
from confkv.errors import ConfigError, PromptTooLongError
from confkv.eval.niah import (PROTOCOL_VERSIONS, PROTOCOLS, NiahConfig, check_niah_positions,
                              full_kv_bytes, load_records, memory_params, parse_spec,
                              plot_niah, record_key, run_key, run_niah_batch, run_niah_grid,
                              run_query_aware_shared, write_niah)
from confkv.config import StoreConfig
from confkv.models import tiny_model, tiny_tokenizer


def test_grid_both_protocols_scores_and_heatmap(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    config = NiahConfig(lengths=(120, 160), depths=(0.0, 1.0), trials=1, policies=("full", "streaming", "confkv"),
                        chunk=64, max_new_tokens=3, extra_params={"protect": 4})
    result = run_niah_grid(model, tok, config, progress=False)
    assert len(result.records) == 2 * 2 * 1 * 3 * 2
    assert {r.protocol for r in result.records} == {"query-aware", "streaming"}
    for r in result.records:  # 3 byte tokens cannot hold the answer (>= 4 digits): never correct
        assert len(r.answer) > 3 and r.correct is False
    # memory: each cache holds 25% of the full cache's bytes at its own length (the default target)
    assert result.budget_bytes == {120: 0.25 * full_kv_bytes(model, 120), 160: 0.25 * full_kv_bytes(model, 160)}
    assert result.budgets["streaming@120"] == result.budgets["confkv@160"] == {"protect": 4, "memory": 0.25}
    # evicting policies hold a quarter of the tokens when answering; full holds everything
    for r in result.records:
        if r.policy == "full":
            assert r.kept_at_answer == r.length
        else:
            assert r.kept_at_answer <= 0.25 * (r.length + 1)
    grid = result.grid("full", "streaming")
    assert len(grid) == 2 and len(grid[0]) == 2
    paths = write_niah(result, tmp_path)
    png = plot_niah(result, tmp_path / "niah_heatmap.png")
    assert all(p.exists() for p in paths) and png.stat().st_size > 1000
    assert len((tmp_path / "niah.csv").read_text().splitlines()) == len(result.records) + 1


def test_record_correct_is_the_expected_answer_not_a_rescoring(monkeypatch):
    """A record's ``correct`` against answers fixed here, not against ``score_niah`` itself.

    The generation is replaced by known texts: the answer itself with words around it (correct),
    the answer with an extra digit, a different number before the answer, and no number (all
    wrong). ``run_niah_grid`` looks ``run_niah_batch`` up in its own module's globals, patched here.
    """
    model, tok = tiny_model("llama"), tiny_tokenizer()
    depths = (0.0, 0.25, 0.5, 1.0)
    texts = {0.0: "The special magic number is {a}.", 0.25: "{a}7", 0.5: "It is 12 then {a}", 1.0: "I forgot it."}
    expected = {0.0: True, 0.25: False, 0.5: False, 1.0: False}

    def fake_batch(model, tokenizer, samples, policy, params, protocol, **kwargs):
        return [(texts[s.depth].format(a=s.answer), 7, 1000.0, 1000.0) for s in samples]

    grid_globals = run_niah_grid.__globals__
    assert "run_niah_batch" in grid_globals
    monkeypatch.setitem(grid_globals, "run_niah_batch", fake_batch)
    config = NiahConfig(lengths=(120,), depths=depths, trials=1, policies=("full",), chunk=64, max_new_tokens=3)
    result = run_niah_grid(model, tok, config, progress=False)
    assert len(result.records) == len(depths) * 2  # both protocols
    for r in result.records:
        assert r.answer.isdigit() and len(r.answer) >= 4
        assert r.generated == texts[r.depth].format(a=r.answer)
        assert r.correct is expected[r.depth], (r.depth, r.generated, r.answer)


def test_full_cache_both_protocols_equal_plain_generate():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    samples = [make_niah_sample(tok, context_tokens=150, depth=d, trial=0) for d in (0.2, 0.8)]
    ids = torch.cat([s.input_ids for s in samples])
    with torch.no_grad():
        plain = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4,
                               pad_token_id=tok.pad_token_id)
    expected = tok.batch_decode(plain[:, ids.shape[1]:], skip_special_tokens=True)
    for protocol in ("query-aware", "streaming"):
        outs = run_niah_batch(model, tok, samples, "full", {}, protocol, store=StoreConfig(), chunk=48,
                              max_new_tokens=4)
        assert [o[0] for o in outs] == expected


def test_memory_params_are_the_policys_params_and_the_target():
    extra = {"protect": 4, "bits": 4, "tiered:ladder": [8, 4]}
    assert memory_params("full", 0.25, extra) == {}
    assert memory_params("window", 0.25, extra) == {"protect": 4, "memory": 0.25}  # no bits: window lacks it
    assert memory_params("tiered", 0.5, extra) == {"protect": 4, "ladder": [8, 4], "memory": 0.5}
    with pytest.raises(ConfigError, match="confkv-r at memory 0.25: storage: policy 'confkv-r' brings its own"):
        memory_params("confkv-r", 0.25, {})
    with pytest.raises(ConfigError, match="memory"):
        NiahConfig(memory=0.0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_full_kv_bytes_is_what_the_full_cache_holds(arch):
    """The NIAH budget's reference: gemma3's sliding-window layers hold only their window."""
    from confkv.hf import ConfKVCache, prefill

    model = tiny_model(arch)
    ids = torch.randint(5, model.config.vocab_size, (1, 60))
    cache = ConfKVCache.for_model(model, "full")
    with torch.no_grad():
        logits = prefill(model, cache, ids, chunk=16)
    cache.end_step(logits[:, -1:])
    assert cache.kv_bytes() == full_kv_bytes(model, 60)
    if arch == "gemma3":  # windowed layers: far less than 60 tokens x every layer
        assert full_kv_bytes(model, 60) < 0.5 * 60 * full_kv_bytes(model, 1)
    # so a 25% target really evicts: the window policy under it keeps fewer tokens than the prompt
    held = ConfKVCache.for_model(model, "window", memory=0.25)
    with torch.no_grad():
        logits = prefill(model, held, ids, chunk=16)
    step = held.trace.steps[-1]
    assert held.kept_counts().max() < 60 and held.kv_bytes() <= step.target_bytes < full_kv_bytes(model, 60)


def _small_config(**overrides):
    base = dict(lengths=(120, 160), depths=(0.0, 1.0), trials=2, chunk=64, max_new_tokens=3,
                policies=("full", "window", "h2o", "tova", "confkv", "confkv+int8"),
                extra_params={"protect": 4}, fp_window=8, batch=2)
    base.update(overrides)
    return NiahConfig(**base)


def _answers(result):
    return {(r.policy, r.protocol, r.length, r.depth, r.trial): r.generated for r in result.records}


def test_shared_prefill_and_full_once_match_separate_runs():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    shared = run_niah_grid(model, tok, _small_config(), progress=False)
    separate = run_niah_grid(model, tok, _small_config(share_prefill=False, full_once=False), progress=False)
    assert len(shared.records) == len(separate.records) == 2 * 2 * 2 * 6 * 2
    assert _answers(shared) == _answers(separate)
    full = [r for r in shared.records if r.policy == "full"]
    assert {r.computed_in for r in full} == {"query-aware"} and {r.protocol for r in full} == set(PROTOCOLS)
    # the INT8 entry runs under the same target (its INT8 tokens are smaller: it holds more of them)
    assert shared.budgets["confkv+int8@160"] == shared.budgets["confkv@160"] == {"protect": 4, "memory": 0.25}


def test_relative_to_full_uses_the_same_samples():
    from confkv.eval.niah import NiahRecord, NiahResult

    def rec(policy, trial, correct):
        return NiahRecord(policy=policy, protocol="streaming", length=100, depth=0.5, trial=trial, actual_depth=0.5,
                          answer="1", generated="", correct=correct, params={}, kept_at_answer=0,
                          peak_kv_bytes_per_seq=0, seconds_per_seq=0)

    records = [rec("full", 0, True), rec("full", 1, True), rec("full", 2, False), rec("full", 3, True),
               rec("h2o", 0, True), rec("h2o", 1, False), rec("h2o", 2, True)]  # trial 3 not run yet
    result = NiahResult(config=NiahConfig(policies=("full", "h2o"), protocols=("streaming",)), records=records,
                        budgets={}, budget_bytes={}, seconds=0)
    assert result.accuracy("h2o", "streaming") == 2 / 3
    assert result.relative_to_full("h2o", "streaming") == 2 / 2  # full hits 2 of trials 0-2
    assert result.relative_to_full("full", "streaming") == 1.0
    assert result.relative_to_full("h2o", "query-aware") != result.relative_to_full("h2o", "query-aware")  # NaN


def test_resume_skips_done_records_and_never_duplicates(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    path = tmp_path / "niah.jsonl"
    small = _small_config(trials=1, policies=("full", "window"))
    first = run_niah_grid(model, tok, small, progress=False, resume_path=path)
    lines = path.read_text().splitlines()
    assert len(lines) == len(first.records) == 2 * 2 * 1 * 2 * 2
    # a kill in the middle of a write leaves a torn line: it is ignored
    with open(path, "a") as handle:
        handle.write(lines[0][: len(lines[0]) // 2])
    bigger = _small_config(trials=2, policies=("full", "window"))
    second = run_niah_grid(model, tok, bigger, progress=False, resume_path=path)
    keys = [record_key(r) for r in second.records]
    assert len(keys) == len(set(keys)) == 2 * 2 * 2 * 2 * 2
    assert {record_key(r) for r in first.records} <= set(keys)
    on_disk = [record_key(r) for r in load_records(path)]
    assert len(on_disk) == len(set(on_disk)) == len(keys)
    again = run_niah_grid(model, tok, bigger, progress=False, resume_path=path)  # nothing left to do
    assert _answers(again) == _answers(second) and len(load_records(path)) == len(keys)
    # another run's settings never resume into this one
    other = run_niah_grid(model, tok, _small_config(lengths=(120,), policies=("window",), memory=0.5),
                          progress=False, resume_path=path)  # another memory target
    assert all(r.run == run_key(other.config, "") != run_key(bigger, "") for r in other.records)
    assert len(other.records) == 1 * 2 * 2 * 1 * 2


def test_policy_specs_are_checked():
    assert parse_spec("confkv+int8") == ("confkv", True) and parse_spec("h2o") == ("h2o", False)
    with pytest.raises(ValueError, match=r"\+int8"):
        parse_spec("confkv+int4")
    with pytest.raises(ConfigError, match="known: .*confkv"):
        parse_spec("nope")
    from confkv.eval.niah.config import _store_for, slack_of

    assert parse_spec("tiered+slack64") == ("tiered", False) and slack_of("tiered+slack64") == 64
    assert parse_spec("confkv+int8+slack8") == ("confkv", True) and slack_of("confkv+int8+slack8") == 8
    assert slack_of("confkv+int8") == 0
    for bad in ("tiered+slack", "tiered+slack-1", "tiered+slack8+slack8", "tiered+slack8+slack9", "tiered+int8+int8"):
        with pytest.raises(ValueError, match="suffix"):
            parse_spec(bad)
    config = _small_config(policies=("tiered+slack16",))
    assert _store_for("tiered+slack16", config).evict_slack == 16 and _store_for("tiered", config).evict_slack == 0


def test_a_shared_prefill_keeps_slacks_apart():
    """Query-aware policies share one prefill per store setting (forked per policy): a fork keeps the shared
    cache's store, so an entry with slack must not share a prefill with the same policy without it."""
    from confkv.eval.niah.runner import _groups

    config = _small_config(policies=("window", "window+slack8", "window+int8"), memory=0.5)
    groups = _groups(["window", "window+slack8", "window+int8"], "query-aware", config)
    assert sorted(map(sorted, groups)) == [["window"], ["window+int8"], ["window+slack8"]]


def test_collect_only_reads_records_without_running(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    path = tmp_path / "niah.jsonl"
    config = _small_config(trials=1, policies=("full", "window"))
    done = run_niah_grid(model, tok, config, progress=False, resume_path=path)
    bigger = _small_config(trials=3, policies=("full", "window"))
    collected = run_niah_grid(model, tok, bigger, progress=False, resume_path=path, compute=False)
    assert _answers(collected) == _answers(done) and len(load_records(path)) == len(done.records)


def test_full_once_fills_a_protocol_added_later(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    path = tmp_path / "niah.jsonl"
    one = _small_config(trials=1, policies=("full", "window"), protocols=("query-aware",))
    run_niah_grid(model, tok, one, progress=False, resume_path=path)
    both = _small_config(trials=1, policies=("full", "window"))
    result = run_niah_grid(model, tok, both, progress=False, resume_path=path)
    assert result.count("full", "streaming") == result.count("full", "query-aware") == 2 * 2


def test_first_trial_splits_a_grid_over_runs(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    path = tmp_path / "niah.jsonl"
    whole = run_niah_grid(model, tok, _small_config(trials=2, policies=("window",)), progress=False)
    for first in (1, 0):  # two "processes", one trial each, into one file
        run_niah_grid(model, tok, _small_config(trials=1, first_trial=first, policies=("window",)), progress=False,
                      resume_path=path)
    collected = run_niah_grid(model, tok, _small_config(trials=2, policies=("window",)), progress=False,
                              resume_path=path, compute=False)
    assert _answers(collected) == _answers(whole) and len(load_records(path)) == len(whole.records)


def test_query_aware_feeds_the_question_as_its_own_last_chunk(monkeypatch):
    import confkv.hf

    model, tok = tiny_model("llama"), tiny_tokenizer()
    samples = [make_niah_sample(tok, context_tokens=150, depth=0.5, trial=0)]
    fed = []
    real_prefill = confkv.hf.prefill

    def recording_prefill(model, cache, ids, **kwargs):
        fed.append(ids.shape[1])
        return real_prefill(model, cache, ids, **kwargs)

    monkeypatch.setattr(confkv.hf, "prefill", recording_prefill)
    question = samples[0].question_ids.shape[1]
    context = samples[0].context_ids.shape[1]
    for runner in ("alone", "shared"):
        fed.clear()
        if runner == "alone":
            run_niah_batch(model, tok, samples, "tova", {"budget": 40, "protect": 4}, "query-aware",
                           store=StoreConfig(), chunk=64, max_new_tokens=2)
        else:
            run_query_aware_shared(model, tok, samples, [("tova", {"budget": 40, "protect": 4}), ("full", {})],
                                   store=StoreConfig(), chunk=64, max_new_tokens=2)
        assert fed == [context, question - 1], runner


def test_records_of_another_protocol_version_are_recomputed(tmp_path):
    import json

    model, tok = tiny_model("llama"), tiny_tokenizer()
    path = tmp_path / "niah.jsonl"
    config = _small_config(lengths=(120,), trials=1, policies=("full", "window"))
    first = run_niah_grid(model, tok, config, progress=False, resume_path=path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:  # pretend the query-aware rows came from protocol version 1
        if row["protocol"] == "query-aware":
            row["protocol_version"] = 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    again = run_niah_grid(model, tok, config, progress=False, resume_path=path)
    assert len(again.records) == len(first.records)
    assert {r.protocol_version for r in again.records if r.protocol == "query-aware"} == {PROTOCOL_VERSIONS["query-aware"]}
    assert len(load_records(path)) == len(rows) + sum(r.protocol == "query-aware" for r in first.records)


def test_lengths_past_the_model_positions_are_refused_before_any_work(tmp_path):
    """Tiny models have 1024 positions: a longer prompt is an error naming the longest length that fits;
    answer tokens past the end are an error with learned positions (GPT-2) and a warning with RoPE."""
    tok = tiny_tokenizer()
    path = tmp_path / "niah.jsonl"
    config = NiahConfig(lengths=(120, 1030), depths=(0.5,), trials=1, policies=("full",), max_new_tokens=4)
    with pytest.raises(PromptTooLongError, match=r"1030 exceeds the model's 1024 positions; use --lengths up to 1020"):
        run_niah_grid(tiny_model("llama"), tok, config, progress=False, resume_path=path)
    assert not path.exists()  # refused before any sample ran
    edge = NiahConfig(lengths=(1022,), depths=(0.5,), trials=1, policies=("full",), max_new_tokens=4)
    with pytest.raises(PromptTooLongError, match=r"1022 \+ 4 answer tokens exceeds the model's 1024 positions"):
        run_niah_grid(tiny_model("gpt2"), tok, edge, progress=False)
    check_niah_positions(tiny_model("gpt2"), (1020,), 4)  # fits exactly: no error
    with pytest.warns(UserWarning, match="RoPE extrapolation"):
        check_niah_positions(tiny_model("llama"), (1022,), 4)


def test_records_of_a_preset_whose_defaults_changed_are_recomputed(tmp_path, monkeypatch):
    """The run key holds the command's parameters, not a preset's storage: each record carries the preset's
    signature, so a preset whose defaults changed is computed again (full KV's records are resumed)."""
    import dataclasses

    from confkv import presets

    model, tok = tiny_model("llama"), tiny_tokenizer()
    path = tmp_path / "niah.jsonl"
    config = _small_config(lengths=(120,), trials=1, policies=("full", "tiered"), protocols=("streaming",))
    first = run_niah_grid(model, tok, config, progress=False, resume_path=path)
    assert {r.preset for r in first.records if r.policy == "tiered"} == {presets.preset_signature("tiered")}
    assert {r.preset for r in first.records if r.policy == "full"} == {None}
    again = run_niah_grid(model, tok, config, progress=False, resume_path=path)
    assert len(load_records(path)) == len(first.records)  # same preset: nothing recomputed
    changed = dataclasses.replace(presets.PRESETS["tiered"], storage=dataclasses.replace(
        presets.PRESETS["tiered"].storage, seal_early=False))
    monkeypatch.setitem(presets.PRESETS, "tiered", changed)
    third = run_niah_grid(model, tok, config, progress=False, resume_path=path)
    tiered = sum(r.policy == "tiered" for r in first.records)
    assert tiered and len(load_records(path)) == len(first.records) + tiered  # only the preset's rows again
    assert len(third.records) == len(again.records)  # the stale rows are not part of the result
    assert {r.preset for r in third.records if r.policy == "tiered"} == {presets.preset_signature("tiered")}
