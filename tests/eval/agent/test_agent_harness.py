"""The agent harness end to end on a tiny model: both protocols, matched memory, resumable JSONL."""

import json

import pytest
import torch

from confkv.eval.agent import build_tasks, make_world
from confkv.eval.agent import harness
from confkv.eval.agent.expert import run_plan
from confkv.eval.agent.env import WebEnv
from confkv.eval.agent.grid import AgentConfig, run_agent_grid, summarize, summary_lines
from confkv.eval.agent.prompt import ChatFormat
from confkv.config import StoreConfig
from confkv.eval.jsonl import load_rows
from confkv.hf import ConfKVCache, prefill
from confkv.models import tiny_model, tiny_tokenizer

WORLD = make_world(0)
TASK = next(t for t in build_tasks(WORLD) if t.tid == "cart_total-0")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", max_position_embeddings=16384)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _oracle(tok, texts):
    """A stand-in for greedy_action that 'generates' the given action texts in turn."""
    queue = list(texts)

    def fake(model, tokenizer, cache, logits, max_new_tokens):
        return harness.encode(tok, queue.pop(0)) + [tok.eos_token_id]
    return fake


def test_clone_runs_on_its_own(model):
    cache = ConfKVCache.for_model(model, "window", budget=32)
    ids = torch.randint(0, 255, (1, 90), generator=torch.Generator().manual_seed(0))
    prefill(model, cache, ids, chunk=16)
    twin = cache.clone()
    before = (cache.get_seq_length(), len(cache.trace), cache.kept_counts().clone())
    a = prefill(model, twin, ids[:, :7])
    assert (cache.get_seq_length(), len(cache.trace)) == before[:2] and torch.equal(cache.kept_counts(), before[2])
    assert twin.get_seq_length() == 97 and len(twin.trace) == before[1] + 1
    b = prefill(model, cache, ids[:, :7])
    torch.testing.assert_close(a, b)


def test_teacher_forced_feeds_the_expert_history(model, tok):
    fmt = ChatFormat.for_tokenizer(tok)
    episode = harness.run_episode(model, tok, WORLD, TASK, "teacher-forced", "window", {"budget": 256},
                                  store=StoreConfig(), chunk=128, max_new_tokens=4, max_steps=3, fmt=fmt)
    assert len(episode.steps) == 3 and episode.tokens == harness.expert_history_tokens(tok, WORLD, TASK, fmt, 3)
    assert [s["expert"] for s in episode.steps] == [s.action.canonical() for s in
                                                   run_plan(WebEnv(WORLD, TASK.start_url, TASK.cart), TASK.plan)[:3]]
    assert episode.peak_kv_bytes > 0 and 0 < episode.mean_kv_bytes <= episode.peak_kv_bytes


def test_an_oracle_model_solves_the_task_in_both_protocols(model, tok, monkeypatch):
    expert = [s.action.canonical() for s in run_plan(WebEnv(WORLD, TASK.start_url, TASK.cart), TASK.plan)]
    for protocol in ("closed-loop", "teacher-forced"):
        monkeypatch.setattr(harness, "greedy_action", _oracle(tok, expert))
        episode = harness.run_episode(model, tok, WORLD, TASK, protocol, "window", {"budget": 256},
                                      store=StoreConfig(), chunk=256, max_new_tokens=4)
        assert len(episode.steps) == len(expert)
        if protocol == "closed-loop":
            assert episode.success and all(s["ok"] for s in episode.steps) and episode.answer
        else:
            assert all(s["agree"] for s in episode.steps)


def test_unreadable_actions_are_failed_steps(model, tok, monkeypatch):
    monkeypatch.setattr(harness, "greedy_action", _oracle(tok, ["I am not sure what to do"] * 3 + ["click [999]"]))
    episode = harness.run_episode(model, tok, WORLD, TASK, "closed-loop", "window", {"budget": 128},
                                  store=StoreConfig(), max_new_tokens=4, max_steps=4)
    assert [s["ok"] for s in episode.steps] == [False] * 4 and episode.success is False
    assert episode.steps[0]["predicted"] == "invalid" and "no element [999]" in episode.steps[3]["error"]


def test_out_of_positions_ends_the_episode_early(tok):
    small = tiny_model("llama")  # 1024 positions: one observation and a bit
    episode = harness.run_episode(small, tok, WORLD, TASK, "teacher-forced", "full", {}, store=StoreConfig(),
                                  max_new_tokens=4)
    assert episode.truncated and len(episode.steps) < 3


def test_grid_both_protocols_under_a_memory_target_and_resume(model, tok, tmp_path, monkeypatch):
    config = AgentConfig(policies=("full", "window", "confkv+int8"), tasks=("cart_total-0",), memory=(1 / 3,),
                         max_steps=2, max_new_tokens=4)
    path = tmp_path / "agent.jsonl"
    records = run_agent_grid(model, tok, config, path, progress=False)
    assert len(records) == 2 * 3 and len(load_rows(path)) == 6
    by = {(r["protocol"], r["policy"]): r for r in records}
    assert by[("teacher-forced", "full")]["agree_full"] == 1.0
    assert by[("teacher-forced", "window")]["agree_full"] is not None
    assert by[("closed-loop", "window")]["success"] is False
    full_peak = by[("teacher-forced", "full")]["peak_kv_bytes"]
    # a third of the full cache's bytes, or a little less; INT8 tokens are planned at full precision
    # (the planner's hot budget), so the INT8 store holds less than its target
    assert 3.0 <= full_peak / by[("teacher-forced", "window")]["peak_kv_bytes"] <= 3.5
    assert 3.0 <= full_peak / by[("teacher-forced", "confkv+int8")]["peak_kv_bytes"]
    for spec in ("window", "confkv+int8"):
        assert by[("teacher-forced", spec)]["memory"] == pytest.approx(1 / 3)
        assert by[("teacher-forced", spec)]["compression"] == pytest.approx(3.0)
    rows = summarize(records)
    assert len(rows) == 6 and any("vs full" in line for line in summary_lines(rows))

    def boom(*args, **kwargs):
        raise AssertionError("a finished episode was run again")
    monkeypatch.setattr("confkv.eval.agent.grid.run_episode", boom)
    again = run_agent_grid(model, tok, config, path, progress=False)
    assert len(again) == 6 and len(load_rows(path)) == 6
    with open(path, "a") as handle:
        handle.write('{"torn": ')  # a kill in the middle of a write
    assert len(run_agent_grid(model, tok, config, path, progress=False)) == 6


@pytest.mark.parametrize("kwargs, field", [({"protocols": ("streaming",)}, "protocols"),
                                           ({"memory": (1.5,)}, "memory"),
                                           ({"policies": ("confkv-r",)}, "confkv-r at memory"),
                                           ({"policies": ("nope",)}, "nope"), ({"max_steps": 0}, "max_steps"),
                                           ({"limit": -1}, "limit"), ({"chunk": 0}, "chunk")])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(Exception, match=field):
        AgentConfig(**kwargs)


def test_unknown_task_names_the_field():
    from confkv.eval.agent.grid import select_tasks

    with pytest.raises(ValueError, match="tasks: unknown 'shop-9'"):
        select_tasks(AgentConfig(tasks=("shop-9",)))
    assert len(select_tasks(AgentConfig(tasks=("wiki_earliest",)))) == 7


def test_agent_cli(tmp_path):
    from confkv.cli import main

    model_dir = tmp_path / "tiny"
    tiny_model("llama", max_position_embeddings=8192).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "out"
    argv = ["agent", "--model", str(model_dir), "--policies", "full,window", "--protocols", "teacher-forced",
            "--memory", "0.36", "--tasks", "wiki_earliest-0", "--max-steps", "1", "--max-new-tokens", "3",
            "--no-progress", "--out-dir", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "agent_summary.json").read_text())
    assert {r["policy"] for r in summary["summary"]} == {"full", "window"}
    assert main(argv + ["--collect-only"]) == 0 and len(load_rows(out / "agent.jsonl")) == 2
    md = (out / "agent.md").read_text()
    assert "--collect-only" in md and "| teacher-forced | window | 2.78 | 1 |" in md
    assert (out / "agent.png").read_bytes()[:4] == b"\x89PNG"
