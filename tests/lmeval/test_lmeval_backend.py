"""The lm-evaluation-harness backend (``lm_eval --model confkv``) on tiny random models, offline.

Skipped where lm-eval is not installed (it is in the ``dev`` and ``lmeval`` extras).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

import confkv.lmeval  # noqa: E402,F401  (registers "confkv")
from confkv.errors import ConfigError  # noqa: E402
from confkv.models import tiny_model, tiny_tokenizer  # noqa: E402

TOY = Path(__file__).parent / "lmeval_toy"


def _tasks(*paths, **metadata):
    """A task manager that indexes only ``paths`` (lm-eval's built-in index takes ~25 s)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(p) for p in paths], include_defaults=False, metadata=metadata or None)


def _backend(args: str):
    return lm_eval.api.registry.get_model("confkv").create_from_arg_string(args)


def _instances(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


CONTEXTS = [("hello world " * 3).strip(), ("the quick brown fox " * 6).strip(), ("a b c d e f g " * 10).strip()]


def test_registered_under_confkv():
    from confkv.lmeval import ConfKVLM

    assert lm_eval.api.registry.get_model("confkv") is ConfKVLM


def test_full_cache_loglikelihood_equals_the_plain_model():
    lm = _backend("model=tiny-llama,policy=full,batch_size=2,chunk=8")
    got = lm.loglikelihood(_instances("loglikelihood", [(c, " xyz") for c in CONTEXTS]), disable_tqdm=True)
    reference = tiny_model("llama")
    tok = tiny_tokenizer()
    for context, (logprob, _) in zip(CONTEXTS, got):
        ctx = tok(context)["input_ids"]
        whole = tok(context + " xyz")["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(reference(torch.tensor([whole])).logits[0].float(), -1)
        want = sum(float(lp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))
        assert logprob == pytest.approx(want, abs=1e-4)


def test_full_cache_generation_equals_plain_greedy_decoding():
    lm = _backend("model=tiny-llama,policy=full,batch_size=3,chunk=8")
    got = lm.generate_until(_instances("generate_until", [(c, {"until": [], "max_gen_toks": 6}) for c in CONTEXTS]),
                            disable_tqdm=True)
    reference = tiny_model("llama")
    tok = tiny_tokenizer()
    for context, text in zip(CONTEXTS, got):
        ids = torch.tensor([tok(context)["input_ids"]])
        out = reference.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        assert text == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_compressed_batches_equal_one_request_at_a_time():
    # same token length: no padding, so every row sees the same chunk boundaries as alone
    # (rows of different lengths are left-padded, which shifts where their chunks end)
    same_length = ["the quick brown fox " * 6, "jumps over lazy dogs" * 6, "0123456789abcdefghij" * 6]
    requests = [(c, {"until": [], "max_gen_toks": 5}) for c in same_length]
    one = _backend("model=tiny-llama,policy=tova,budget=24,chunk=8,batch_size=1")
    many = _backend("model=tiny-llama,policy=tova,budget=24,chunk=8,batch_size=3")
    alone = one.generate_until(_instances("generate_until", requests), disable_tqdm=True)
    batched = many.generate_until(_instances("generate_until", requests), disable_tqdm=True)
    assert batched == alone
    # and the cache really was compressed: the budget is below the longest prompt
    assert many.policy_params(200)["budget"] < 140


def test_stop_strings_cut_the_continuation():
    lm = _backend("model=tiny-llama,policy=window,budget=32,chunk=8")
    free = lm.generate_until(_instances("generate_until", [(CONTEXTS[1], {"until": [], "max_gen_toks": 8})]),
                             disable_tqdm=True)[0]
    stop = free[2:4]
    cut = lm.generate_until(_instances("generate_until", [(CONTEXTS[1], {"until": [stop], "max_gen_toks": 8})]),
                            disable_tqdm=True)[0]
    assert stop not in cut and free.startswith(cut)


def test_query_aware_protocol_runs_and_differs_from_nothing_when_budget_is_loose():
    requests = [(c, {"until": [], "max_gen_toks": 4}) for c in CONTEXTS]
    full = _backend("model=tiny-llama,policy=full,chunk=8")
    loose = _backend("model=tiny-llama,policy=tova,budget=1000,chunk=8,protocol=query-aware,query_window=8")
    assert loose.generate_until(_instances("generate_until", requests), disable_tqdm=True) == \
        full.generate_until(_instances("generate_until", requests), disable_tqdm=True)


@pytest.mark.parametrize("args, named", [
    ("model=tiny-llama,policy=tovaa", "tovaa"),
    ("model=tiny-llama,policy=tova,budgt=64", "budgt"),
    ("model=tiny-llama,policy=confkv,n_hihg=64", "n_hihg"),
    ("model=tiny-llama,policy=tova,kv_fraction=0.25", "kv_fraction=0.25: removed .* give memory=F"),
    ("model=tiny-llama,policy=tova,memory=1.5", "memory=1.5"),
    ("model=tiny-llama,policy=tova,protocol=sideways", "protocol"),
    ("model=tiny-llama,policy=full,memory=0.5", "policy=full"),
])
def test_bad_model_args_get_an_error_naming_them(args, named):
    with pytest.raises(ConfigError, match=named):
        _backend(args)


def test_simple_evaluate_on_a_local_toy_task():
    results = lm_eval.simple_evaluate(model="confkv", model_args="model=tiny-llama,policy=tova,budget=16,chunk=8",
                                      tasks=["confkv_toy_gen", "confkv_toy_mc", "confkv_ruler_fwe"],
                                      task_manager=_tasks(TOY, confkv.lmeval.task_dir(), max_seq_lengths=[1024],
                                                          num_samples=2, model="tiny-llama"),
                                      batch_size=2, log_samples=True)
    assert results["results"]["confkv_toy_gen"]["answered,none"] == 1.0
    # confkv's offline RULER task: two samples generated with the backend's tokenizer, scored per length
    ruler = results["samples"]["confkv_ruler_fwe"]
    assert len(ruler) == 2 and all(s["doc"]["max_length"] == 1024 for s in ruler)
    assert 0.0 <= results["results"]["confkv_ruler_fwe"]["1024,none"] <= 1.0
    assert 0.0 <= results["results"]["confkv_toy_mc"]["acc,none"] <= 1.0
    assert len(results["samples"]["confkv_toy_mc"]) == 4
    assert results["config"]["confkv_policy"] == "tova"


@pytest.fixture
def network_blocked(monkeypatch):
    """No socket can connect, and the Hugging Face libraries are told they are offline."""
    import socket

    def refuse(*args, **kwargs):
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_runs_with_the_network_blocked_and_names_a_model_that_is_not_here(network_blocked):
    results = lm_eval.simple_evaluate(model="confkv", model_args="model=tiny-llama,policy=streaming,budget=16,chunk=8",
                                      tasks=["confkv_toy_mc"], task_manager=_tasks(TOY))
    assert 0.0 <= results["results"]["confkv_toy_mc"]["acc,none"] <= 1.0
    from confkv.models import ModelLoadError

    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model"):
        lm_eval.simple_evaluate(model="confkv", model_args="model=no-such-org/no-such-model,policy=tova,budget=16",
                                tasks=["confkv_toy_mc"], task_manager=_tasks(TOY))
