"""Every grid sets memory one way: the cache holds ``memory`` of the full cache's bytes at every step.

No offline replay: each test reads the bytes the cache held from its trace and checks them
against the target the cache planned (``StepRecord.target_bytes``), and the target against
``memory x`` the full cache's bytes (:func:`confkv.tiers.byte_model.full_cache_bytes`).
"""

import json

import pytest
import torch

from confkv.errors import ConfigError
from confkv.eval.quality.ppl import streaming_ppl
from confkv.tiers.planner import smallest_budget
from confkv.models import tiny_model, tiny_tokenizer
from confkv.presets import resolve
from confkv.hf.support import kv_shape
from confkv.tiers.byte_model import full_cache_bytes


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def check_trace_under_target(model, trace, memory, policy, batch=1, after=0, store=None, **params):
    """Every step with a plan: its target is ``memory`` x the full cache's bytes at that length (or the
    cache's floor, its smallest hot set, for a short prefix), and the bytes held are at most it.
    Returns the steps checked (a llama: no sliding layers)."""
    from confkv.config import StoreConfig
    from confkv.tiers.planner import floor_tokens as floor_tokens_of, reserve_bytes

    shape = kv_shape(model)
    store = store or StoreConfig()
    floor_tokens = floor_tokens_of(resolve(policy, memory=memory, **params).policy, store)
    reserve = reserve_bytes(shape, store)
    planned = [step for step in trace.steps if step.target_bytes is not None]
    for step in planned:
        if step.seen < after:
            continue
        full = full_cache_bytes(shape, step.seen, batch)
        floor = len(shape.sliding_windows) * batch * (min(step.seen, floor_tokens) * shape.token_bytes + reserve)
        assert step.target_bytes == max(int(memory * full), floor)
        assert int(step.kv_bytes.sum()) <= step.target_bytes
    return planned


# --------------------------------------------------------------------------- the core, every policy

@pytest.mark.parametrize("name,params,int8", [
    ("window", {}, False),
    ("streaming", {}, False),
    ("h2o", {"protect": 4}, False),
    ("tova", {"protect": 4}, True),
    ("confkv", {"protect": 4}, False),
    ("confkv-fixed", {"protect": 4}, True),
    ("confkv-l", {"protect": 4}, False),
    ("scissorhands", {"protect": 4}, False),
    ("random", {"protect": 4}, False),
    ("tiered", {"page_size": 8, "group_size": 8}, False),
    ("tiered", {"page_size": 8, "group_size": 8, "ladder": [8, 4]}, True),
    ("kivi-4", {"page_size": 8, "group_size": 8, "hot_tokens": 16}, False),
    ("kivi-2", {"page_size": 8, "group_size": 8, "hot_tokens": 16}, False),
])
def test_every_policy_and_preset_holds_the_target_at_every_step(model, name, params, int8):
    from confkv.config import StoreConfig

    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(0))
    store = StoreConfig(kv_int8=int8, fp_window=8, move_block=8)
    result = streaming_ppl(model, ids, name, store=store, progress=False, memory=0.25, **params)
    after = 0
    planned = check_trace_under_target(model, result.trace, 0.25, name, after=after, store=store, **params)
    assert len(planned) == 119  # every step was planned


def test_an_int8_store_holds_the_target_from_the_first_step(model):
    from confkv.config import StoreConfig

    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(0))
    result = streaming_ppl(model, ids, "tova", store=StoreConfig(kv_int8=True, fp_window=8, move_block=8),
                           progress=False, memory=0.25, protect=4)
    assert all(int(step.kv_bytes.sum()) <= step.target_bytes for step in result.trace.steps)


def test_the_byte_model_is_what_the_caches_hold():
    """The full cache's bytes (Gemma-3: sliding layers hold their window) and INT8 tokens, as the stores count them."""
    from confkv import quant
    from confkv.config import StoreConfig
    from confkv.hf import ConfKVCache, prefill
    from confkv.tiers import byte_model

    for arch in ("llama", "gemma3"):
        model = tiny_model(arch)
        ids = torch.randint(5, model.config.vocab_size, (2, 60), generator=torch.Generator().manual_seed(3))
        cache = ConfKVCache.for_model(model, "full")
        with torch.no_grad():
            prefill(model, cache, ids, chunk=16)
        assert cache.kv_bytes() == full_cache_bytes(kv_shape(model), 60, batch=2)
    shape = kv_shape(tiny_model("llama"))
    assert (shape.kv_heads, shape.head_dim, shape.element_size) == (2, 16, 4)
    assert shape.token_bytes == byte_model.fp_token_bytes(2, 16, 4) == quant.fp_bytes_per_token(2, 16, torch.float32)
    assert byte_model.int8_token_bytes(2, 16) == quant.int8_bytes_per_token(2, 16) == 2 * (2 * 16 + 2 * 4)
    assert byte_model.channel_scale_bytes(2, 16) == quant.channel_scale_bytes(2, 16) == 2 * 16 * 4
    # an INT8 store's bytes: FP window + INT8 tokens with their scales + one channel scale per layer
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(4))
    trace = streaming_ppl(model, ids, "full", store=StoreConfig(kv_int8=True, fp_window=8, move_block=8),
                          progress=False).trace
    stores_tokens = 59
    last = int(trace.steps[-1].kv_bytes[0])
    recent = last - byte_model.channel_scale_bytes(2, 16)
    int8_tokens = (recent - stores_tokens * byte_model.int8_token_bytes(2, 16)) // (
        shape.token_bytes - byte_model.int8_token_bytes(2, 16))
    assert 8 <= int8_tokens < 16  # the FP window holds fp_window .. fp_window + move_block - 1 tokens


# --------------------------------------------------------------------------- sweep

def test_sweep_runs_every_policy_at_every_memory_and_resumes(model, tmp_path):
    from confkv.eval.quality.sweep import SweepConfig, load_rows, row_key, run_sweep

    tok = tiny_tokenizer()
    config = SweepConfig(policies=("full", "window", "tiered"), memory=(0.5, 0.25), tokens=160, model="tiny",
                         policy_params={"tiered": {"page_size": 8, "group_size": 8, "ladder": [8, 4]}})
    out, traces = tmp_path / "rows.jsonl", tmp_path / "traces"
    partial = run_sweep(config, out, model=model, tokenizer=tok, progress=False, stop_after=2, traces_dir=traces)
    assert len(partial) == 2
    with open(out, "a") as handle:  # a kill in the middle of a row
        handle.write('{"policy": "tiered", "ppl": 1.')
    rows = run_sweep(config, out, model=model, tokenizer=tok, progress=False, traces_dir=traces)
    assert [(r["policy"], r["memory"]) for r in rows] == [("full", None), ("window", 0.5), ("window", 0.25),
                                                         ("tiered", 0.5), ("tiered", 0.25)]
    assert len({row_key(r) for r in load_rows(out)}) == len(load_rows(out)) == 5
    full = rows[0]
    for row in rows[1:]:
        assert row["params"]["memory"] == row["memory"]
        assert row["max_target_share"] <= 1.0
        assert row["peak_kv_bytes"] <= row["memory"] * full["peak_kv_bytes"]
        if row["policy"] == "tiered":
            assert row["params"]["ladder"] == [8, 4] and len(row["final_rung_tokens"]) == 2
    # the traces the runs wrote: every step under its target, the target memory x the full cache's bytes
    from confkv.eval.report.plots import trace_from_dict

    for row in rows[1:]:
        data = json.loads(open(row["trace_file"]).read())
        assert data["summary"]["memory"] == row["memory"] and f"_mem-{row['memory']:g}_" in row["trace_file"]
        params = {k: v for k, v in row["params"].items() if k != "memory"}
        planned = check_trace_under_target(model, trace_from_dict(data["trace"]), row["memory"], row["policy"],
                                           **params)
        assert len(planned) == 159
    assert len(load_rows(out)) == 5 and run_sweep(config, out, model=model, tokenizer=tok, progress=False) == rows


def test_sweep_cli_memory_and_a_preset_storage_field(tmp_path, capsys):
    from confkv.cli import main

    out = tmp_path / "rows.jsonl"
    assert main(["sweep", "--model", "tiny-llama", "--policies", "full,kivi-4,tiered", "--memory", "0.25",
                 "--tokens", "50", "--param", "tiered:ladder=[8,4]", "--param", "*:page_size=8",
                 "--param", "*:group_size=8", "--param", "kivi-4:hot_tokens=8",
                 "--out", str(out), "--no-progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["policy"], r["memory"]) for r in rows] == [("full", None), ("kivi-4", 0.25), ("tiered", 0.25)]
    assert rows[2]["params"] == {"page_size": 8, "group_size": 8, "ladder": [8, 4], "memory": 0.25}
    assert rows[1]["params"] == {"page_size": 8, "group_size": 8, "hot_tokens": 8, "memory": 0.25}
    assert all(r["max_target_share"] <= 1.0 for r in rows[1:])
    assert "memory=0.25" in capsys.readouterr().out


@pytest.mark.parametrize("argv,named", [
    (["--memory", "0"], "--memory"),
    (["--memory", "1.5"], "--memory"),
    (["--memory", "quarter"], "--memory"),
    (["--reference-windows", "512"], "--reference-windows was removed"),
    (["--match", "peak"], "--match was removed"),
])
def test_sweep_bad_memory_values_and_removed_flags_name_the_flag(argv, named, tmp_path, capsys):
    from confkv.cli import main

    with pytest.raises(SystemExit):
        main(["sweep", "--model", "tiny-llama", "--out", str(tmp_path / "r.jsonl"), *argv])
    err = capsys.readouterr().err
    assert named in err and "--memory" in err


def test_sweep_a_bad_storage_field_or_a_policy_that_cannot_run_under_a_target_is_named():
    from confkv.eval.quality.sweep import SweepConfig, plan_sweep

    with pytest.raises(ConfigError, match=r"--param tiered: .*ladder"):
        plan_sweep(SweepConfig(policies=("tiered",), policy_params={"tiered": {"ladder": [8, 5]}}))
    with pytest.raises(ConfigError, match=r"confkv-r at memory 0.25: storage: policy 'confkv-r' brings its own"):
        plan_sweep(SweepConfig(policies=("confkv-r",), memory=(0.25,)))
    with pytest.raises(ConfigError, match="memory"):
        SweepConfig(memory=(0.0,))


# --------------------------------------------------------------------------- niah

def test_niah_grid_both_protocols_under_the_target(model, tmp_path):
    from confkv.eval.niah import NiahConfig, full_kv_bytes, run_niah_grid

    tok = tiny_tokenizer()
    config = NiahConfig(lengths=(120,), depths=(0.5,), policies=("full", "tova", "h2o", "tiered"), chunk=64,
                        max_new_tokens=3, memory=0.25, extra_params={"protect": 4, "tiered:page_size": 8,
                                                                     "tiered:group_size": 8})
    result = run_niah_grid(model, tok, config, progress=False)
    assert result.budget_bytes[120] == 0.25 * full_kv_bytes(model, 120)
    assert result.budgets["tova@120"] == {"protect": 4, "memory": 0.25}
    assert result.budgets["tiered@120"] == {"protect": 4, "page_size": 8, "group_size": 8, "memory": 0.25}
    assert result.budgets["full@120"] == {}
    for r in result.records:
        if r.policy == "full":
            continue
        assert r.params["memory"] == 0.25
        if r.protocol == "streaming":  # the target held at the end of every chunk and token
            assert r.peak_kv_bytes_per_seq <= 0.25 * full_kv_bytes(model, 120 + 3)
        assert r.kept_at_answer <= 0.25 * 120 + 1 or r.policy == "tiered"  # tiered keeps more, at low bits


def test_query_aware_prefills_without_eviction_then_brings_the_prompt_to_the_target(model):
    from confkv.data import make_niah_sample
    from confkv.eval.niah import run_niah_batch
    from confkv.hf import ConfKVCache, prefill

    tok = tiny_tokenizer()
    sample = make_niah_sample(tok, context_tokens=120, depth=0.5, trial=0)
    ids = sample.input_ids[:, :-1]
    cache = ConfKVCache.for_model(model, "tova", memory=0.25, protect=4)
    cache.evict = False
    with torch.no_grad():
        logits = prefill(model, cache, ids, chunk=64)
    assert cache.kv_bytes() == full_cache_bytes(kv_shape(model), ids.shape[1])  # nothing evicted
    assert all(step.target_bytes is None for step in cache.trace.steps)
    cache.evict = True
    cache.end_step(logits[:, -1] if logits.ndim == 3 else logits)
    step = cache.trace.steps[-1]
    assert step.target_bytes == int(0.25 * full_cache_bytes(kv_shape(model), ids.shape[1]))
    assert cache.kv_bytes() <= step.target_bytes
    # the protocol does the same, then answers under the target
    outs = run_niah_batch(model, tok, [sample], "tova", {"memory": 0.25, "protect": 4}, "query-aware",
                          store=cache.store_config, chunk=64, max_new_tokens=3)
    assert outs[0][2] == full_cache_bytes(kv_shape(model), ids.shape[1])  # the peak: the prefilled prompt


def test_a_shared_prefill_forks_under_the_target_as_separate_runs_do(model):
    """TeePolicy: one prefill without eviction, each member's fork brought to the shared target."""
    from confkv.config import StoreConfig
    from confkv.data import make_niah_sample
    from confkv.eval.niah import run_niah_batch, run_query_aware_shared

    tok = tiny_tokenizer()
    samples = [make_niah_sample(tok, context_tokens=120, depth=d, trial=0) for d in (0.0, 1.0)]
    store = StoreConfig(prefill_chunk=64)
    members = [("tova", {"memory": 0.25, "protect": 4}), ("h2o", {"memory": 0.25, "protect": 4}),
               ("confkv-fixed", {"memory": 0.25, "protect": 4})]
    shared = run_query_aware_shared(model, tok, samples, members, store=store, chunk=64, max_new_tokens=4)
    alone = [run_niah_batch(model, tok, samples, name, params, "query-aware", store=store, chunk=64,
                            max_new_tokens=4) for name, params in members]
    assert [[o[0] for o in outs] for outs in shared] == [[o[0] for o in outs] for outs in alone]
    assert [[o[1] for o in outs] for outs in shared] == [[o[1] for o in outs] for outs in alone]
    with pytest.raises(ValueError, match="share one memory target and storage"):
        run_query_aware_shared(model, tok, samples, [("tova", {"memory": 0.25}), ("tova", {"memory": 0.5})],
                               store=store, chunk=64, max_new_tokens=1)


def test_a_fork_keeps_the_shared_caches_target_and_storage(model):
    from confkv.hf import ConfKVCache, prefill
    from confkv.policies import make_policy
    from confkv.policies.tee import TeePolicy
    from confkv.tiers.storage import Storage

    storage = Storage(ladder=(8, 4), page_size=8, group_size=8)
    tee = TeePolicy.of([make_policy("tova", protect=4), make_policy("confkv-fixed", protect=4)])
    shared = ConfKVCache.for_model(model, tee, memory=0.25, storage=storage)
    shared.evict = False
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = prefill(model, shared, ids, chunk=50)
    for member in range(2):
        fork = shared.fork(member)
        assert fork.target == shared.target and fork.storage == storage
        fork.end_step(logits[:, -1] if logits.ndim == 3 else logits)
        assert fork.kv_bytes() <= fork.trace.steps[-1].target_bytes == int(
            0.25 * full_cache_bytes(kv_shape(model), 100))
        assert sum(fork.trace.steps[-1].rung_tokens) > 0  # what the hot tier let go went down the ladder
    assert shared.kv_bytes() == full_cache_bytes(kv_shape(model), 100)  # the shared cache is untouched


def test_niah_cli_memory_scoped_storage_field_and_removed_flags(tmp_path, capsys):
    from confkv.cli import main

    out = tmp_path / "niah"
    assert main(["niah", "--model", "tiny-llama", "--policies", "full,tiered", "--lengths", "120", "--depths", "0.5",
                 "--chunk", "60", "--max-new-tokens", "2", "--memory", "0.5", "--param", "tiered:ladder=[8,4]",
                 "--param", "tiered:page_size=8", "--param", "tiered:group_size=8", "--out-dir", str(out),
                 "--no-progress"]) == 0
    data = json.loads((out / "niah.json").read_text())
    assert data["config"]["memory"] == 0.5 and "budget_fraction" not in data["config"]
    assert data["budgets"]["tiered@120"] == {"ladder": [8, 4], "page_size": 8, "group_size": 8, "memory": 0.5}
    assert {r["params"].get("memory") for r in data["records"] if r["policy"] == "tiered"} == {0.5}
    for flag, value in (("--budget-fraction", "0.25"), ("--budget-of", "each"), ("--budget-tokens", "160")):
        with pytest.raises(SystemExit):
            main(["niah", "--model", "tiny-llama", flag, value, "--out-dir", str(out)])
        err = capsys.readouterr().err
        assert f"{flag} was removed" in err and "--memory" in err
    with pytest.raises(SystemExit):
        main(["niah", "--model", "tiny-llama", "--memory", "2", "--out-dir", str(out)])
    assert "--memory" in capsys.readouterr().err
    assert main(["niah", "--model", "tiny-llama", "--policies", "tiered", "--param", "tiered:ladder=[8,5]",
                 "--out-dir", str(out)]) == 2
    assert "ladder: every rung must be one of" in capsys.readouterr().err


# --------------------------------------------------------------------------- ruler, agent, lm-eval, soak

def test_ruler_memory_and_its_kv_fractions_alias(tmp_path, capsys):
    from confkv.cli import main
    from confkv.eval.jsonl import load_rows

    out = tmp_path / "ruler"
    base = ["ruler", "--model", "tiny-llama", "--tasks", "fwe", "--lengths", "1024", "--policies",
            "full,tova,kivi-4", "--samples", "1", "--chunk", "128", "--no-progress", "--out-dir", str(out),
            "--param", "kivi-4:hot_tokens=16", "--param", "kivi-4:page_size=16", "--param", "kivi-4:group_size=16"]
    assert main([*base, "--memory", "0.25,0.125"]) == 0
    rows = load_rows(out / "ruler.jsonl")
    assert sorted((r["policy"], r["kv_fraction"]) for r in rows) == [
        ("full", 1.0), ("kivi-4", 0.125), ("kivi-4", 0.25), ("tova", 0.125), ("tova", 0.25)]
    full_bytes = full_cache_bytes(kv_shape(tiny_model("llama")), 1024)  # prompt + answer <= the length
    for r in rows:
        if r["policy"] != "full":
            assert r["params"]["memory"] == r["kv_fraction"]
            assert r["peak_kv_bytes_per_seq"] <= r["kv_fraction"] * full_bytes
    # --kv-fractions is the same flag: the same run, nothing new to compute
    assert main([*base, "--kv-fractions", "0.25,0.125"]) == 0
    assert len(load_rows(out / "ruler.jsonl")) == 5
    for bad in (["--memory", "0"], ["--kv-fractions", "1.5"], ["--ratio", "0.5"]):
        with pytest.raises(SystemExit):
            main([*base, *bad])
        err = capsys.readouterr().err
        assert bad[0] in err or "--memory" in err


def test_agent_grid_under_memory_targets(tmp_path, capsys):
    from confkv.eval.agent.grid import AgentConfig, run_agent_grid, summarize
    from confkv.cli import main

    model, tok = tiny_model("llama", max_position_embeddings=8192), tiny_tokenizer()
    config = AgentConfig(policies=("full", "tova", "tiered"), protocols=("teacher-forced",),
                         tasks=("cart_total-0",), memory=(0.5, 0.25), max_steps=2, max_new_tokens=3,
                         extra_params={"tiered:page_size": 8, "tiered:group_size": 8})
    rows = run_agent_grid(model, tok, config, tmp_path / "agent.jsonl", progress=False)
    by = {(r["policy"], r["memory"]): r for r in rows}
    assert set(by) == {("full", 1.0), ("tova", 0.5), ("tova", 0.25), ("tiered", 0.5), ("tiered", 0.25)}
    for (policy, memory), r in by.items():
        assert r["compression"] == pytest.approx(1 / memory)
        if policy != "full":
            assert r["params"]["memory"] == memory
            assert 0 < r["peak_kv_bytes"] <= memory * by[("full", 1.0)]["peak_kv_bytes"]
    assert {row["memory"] for row in summarize(rows)} == {1.0, 0.5, 0.25}
    with pytest.raises(SystemExit):
        main(["agent", "--model", "tiny-llama", "--compressions", "2.8,4", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--compressions was removed" in err and "--memory 0.36,0.25" in err
    with pytest.raises(ValueError, match="memory"):
        AgentConfig(memory=(1.5,))


def test_lmeval_backend_memory_model_arg():
    pytest.importorskip("lm_eval")
    from confkv.lmeval.settings import parse_settings

    settings = parse_settings(model="tiny-llama", policy="tova", memory=0.25, protect=4)
    assert settings.cache_params() == {"protect": 4, "memory": 0.25} and settings.targeted
    assert parse_settings(model="tiny-llama", policy="tiered", memory=0.5, ladder=[8, 4]).cache_params() == {
        "ladder": [8, 4], "memory": 0.5}
    assert parse_settings(model="tiny-llama", policy="window", budget=24).cache_params() == {"budget": 24}
    for args, named in (({"kv_fraction": 0.25}, "kv_fraction=0.25: removed .* memory=0.25"),
                        ({"ratio": 0.5}, "ratio"), ({"memory": 1.5}, "memory=1.5"), ({"memory": 0}, "memory=0"),
                        ({"memory": 0.25, "max_kv_bytes": 1000}, "give one of them"),
                        ({"policy": "tiered", "ladder": [8, 5]}, "ladder"),
                        ({"policy": "full", "memory": 0.25}, "policy=full")):
        with pytest.raises(ConfigError, match=named):
            parse_settings(**{"model": "tiny-llama", "policy": "tova", **args})


def test_lmeval_backend_generates_under_the_target():
    pytest.importorskip("lm_eval")
    from confkv.lmeval.backend import ConfKVLM

    lm = ConfKVLM(model="tiny-llama", policy="tova", memory=0.25, chunk=8)
    assert lm.policy_params(200) == {"memory": 0.25}
    assert lm.get_model_info()["confkv_memory"] == 0.25
    from confkv.hf.protocols import generate_compressed

    prompt = list(range(5, 125))
    out = generate_compressed(lm.model, lm.tokenizer, [prompt], policy="tova", params=lm.policy_params(130),
                              store=lm.store, protocol="query-aware", chunk=8, query_window=8, max_new_tokens=4)
    assert out[0].peak_kv_bytes_per_seq == full_cache_bytes(kv_shape(lm.model), len(prompt) - 1) or \
        out[0].peak_kv_bytes_per_seq <= full_cache_bytes(kv_shape(lm.model), len(prompt))


def test_soak_checks_the_bytes_against_the_target_every_step(tmp_path):
    import numpy as np

    from confkv.eval.quality.soak import main, within_target

    assert within_target(np.array([5, 10, 9]), np.array([6, 10, 10])) == (True, 0, 1.0)
    held, over, share = within_target(np.array([5, 11, 9]), np.array([6, 10, 10]))
    assert not held and over == 1 and share == pytest.approx(1.1)
    assert not within_target(np.array([5, 4]), np.array([6, 0]))[0]  # a step without a target fails the check
    shape = kv_shape(tiny_model("llama"))
    cap = 40 * 2 * shape.token_bytes  # 40 full-precision tokens in each of the 2 layers
    code = main(["--model", "tiny-llama", "--tokens", "120", "--max-kv-bytes", str(cap), "--warmup", "40",
                 "--sample-every", "20", "--param", "page_size=8", "--param", "group_size=8",
                 "--objects-tolerance", "100000", "--rss-tolerance-mb", "1000", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "soak.json").read_text())["summary"]
    assert summary["checks"]["kv_within_target"] and summary["kv_steps_over_target"] == 0
    assert summary["kv_peak_bytes"] <= cap and summary["max_kv_bytes"] == cap and code == 0
    with pytest.raises(SystemExit):  # a target is required
        main(["--model", "tiny-llama", "--tokens", "20", "--out", str(tmp_path)])
