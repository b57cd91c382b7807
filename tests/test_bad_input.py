"""Bad input: one test per row of ``docs/BAD_INPUT.md``.

Every bad input must give a clear error that names the problem and the fix (or, where
the input is legal but unusual, must work). ``python tests/test_bad_input.py`` prints the
table of the simple rows (input -> exact message) that ``docs/BAD_INPUT.md`` reproduces.
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch

from confkv.config import ConfidenceConfig, GateConfig, StoreConfig
from confkv.errors import ConfigError, PromptTooLongError, UnsupportedModelError
from confkv.hf import ConfKVCache, generate, prefill
from confkv.models import ModelLoadError, load_model, tiny_model, tiny_tokenizer
from confkv.policies import make_policy
from confkv.tiers.storage import Storage

_MODELS: dict = {}


def _model(arch: str = "llama"):
    if arch not in _MODELS:
        _MODELS[arch] = tiny_model(arch, seed=7)
    return _MODELS[arch]


def _ids(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 250, (batch, length), generator=torch.Generator().manual_seed(seed))


def _window_cache(model, **params):
    return ConfKVCache.for_model(model, "window", **({"budget": 8} | params))


def _opt_model():
    from transformers import AutoModelForCausalLM, OPTConfig

    config = OPTConfig(vocab_size=260, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
                       word_embed_proj_dim=32)
    return AutoModelForCausalLM.from_config(config)


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- simple rows
# (row id, what is tried, callable, exception type, regex the message must match)
ROWS = [
    ("store-fp-window", "StoreConfig(fp_window=-1)", lambda: StoreConfig(fp_window=-1),
     ConfigError, r"^fp_window: must be >= 0, got -1$"),
    ("store-int8-type", "StoreConfig(kv_int8='yes')", lambda: StoreConfig(kv_int8="yes"),
     ConfigError, r"^kv_int8: must be True or False"),
    ("store-int8-from", "StoreConfig(int8_from='over_budget')", lambda: StoreConfig(int8_from="over_budget"),
     ConfigError, r"^int8_from: applies to an INT8 store only; give kv_int8=True"),
    ("storage-hot-int8-window", "Storage(hot_int8_window=-1)", lambda: Storage(hot_int8_window=-1),
     ConfigError, r"^hot_int8_window: must be None .* or a number of tokens >= 0"),
    ("storage-hot-slack", "Storage(hot_slack=1.0)", lambda: Storage(hot_slack=1.0),
     ConfigError, r"^hot_slack: must be a share of the hot tier's tokens kept by rank"),
    ("storage-open-bits", "Storage(open_bits=2)", lambda: Storage(open_bits=2),
     ConfigError, r"^open_bits: must be 16 \(the model's dtype\), 8 \(INT8 per token\) or 4 \(4 bits per token, "
                  r"rotated\), got 2$"),
    ("storage-ladder-slack", "Storage(ladder_slack=-0.1)", lambda: Storage(ladder_slack=-0.1),
     ConfigError, r"^ladder_slack: must be a share of the ladder's bytes, at least 0 and below 1 .*got -0.1$"),
    ("store-evict-slack", "StoreConfig(evict_slack=1.5)", lambda: StoreConfig(evict_slack=1.5),
     ConfigError, r"^evict_slack: must be a number of tokens \(an integer >= 0\) or a share"),
    ("store-move-block", "StoreConfig(move_block=0)", lambda: StoreConfig(move_block=0),
     ConfigError, r"^move_block: must be >= 1"),
    ("store-chunk-type", "StoreConfig(prefill_chunk=1.5)", lambda: StoreConfig(prefill_chunk=1.5),
     ConfigError, r"^prefill_chunk: must be an integer"),
    ("store-read-backend", "StoreConfig(read_backend='fused')", lambda: StoreConfig(read_backend="fused"),
     ConfigError, r"^read_backend: must be 'auto', 'torch' or 'triton'"),
    ("gate-tau", "make_policy('confkv', tau=1.5)", lambda: make_policy("confkv", tau=1.5),
     ConfigError, r"^tau: must be in \[0, 1\]"),
    ("gate-order", "make_policy('confkv', n_high=900, n_low=100)",
     lambda: make_policy("confkv", n_high=900, n_low=100), ConfigError, r"^n_high: .*must be <= the loose budget"),
    ("gate-smoothing", "GateConfig(smoothing=1.0)", lambda: GateConfig(smoothing=1.0),
     ConfigError, r"^smoothing: must be in \[0, 1\)"),
    ("gate-budget-type", "make_policy('confkv', n_high='64')", lambda: make_policy("confkv", n_high="64"),
     ConfigError, r"^n_high: must be a positive integer"),
    ("conf-weights-zero", "ConfidenceConfig(0, 0, 0)", lambda: ConfidenceConfig(0.0, 0.0, 0.0),
     ConfigError, r"weights are all zero"),
    ("conf-weight-nan", "ConfidenceConfig(w_top=nan)", lambda: ConfidenceConfig(w_top=float("nan")),
     ConfigError, r"^w_top: must be a finite number"),
    ("conf-margin-form", "make_policy('confkv', margin_form='tanh')",
     lambda: make_policy("confkv", margin_form="tanh"), ConfigError, r"^margin_form: must be 'centered' or 'sigmoid'"),
    ("window-budget", "make_policy('window', budget=0)", lambda: make_policy("window", budget=0),
     ConfigError, r"^budget: must be a positive integer"),
    ("protect-vs-budget", "make_policy('streaming', budget=8, protect=8)",
     lambda: make_policy("streaming", budget=8, protect=8), ConfigError, r"^protect: the protected tokens P=8"),
    ("sinks-vs-budget", "make_policy('streaming', budget=8, protect=4, sinks=4)",
     lambda: make_policy("streaming", budget=8, protect=4, sinks=4), ConfigError, r"^sinks: protect \+ sinks = 8"),
    ("h2o-recent-sinks", "make_policy('h2o', budget=3, protect=0, sinks=2)",
     lambda: make_policy("h2o", budget=3, protect=0, sinks=2), ConfigError, r"^sinks: the recent part of the budget"),
    ("ratio-range", "make_policy('h2o', recent_ratio=1.5)", lambda: make_policy("h2o", recent_ratio=1.5),
     ConfigError, r"^recent_ratio: must be a number in \[0, 1\]"),
    ("pyramid-floor", "make_policy('confkv-l', n_high=32, n_low=64)",
     lambda: make_policy("confkv-l", n_high=32, n_low=64), ConfigError, r"^n_high: the tight budget n_high=32"),
    ("int8-window-vs-budget", "for_model(m, 'confkv', n_high=64, n_low=128, store=StoreConfig(kv_int8=True))",
     lambda: ConfKVCache.for_model(_model(), "confkv", n_high=64, n_low=128, store=StoreConfig(kv_int8=True)),
     ConfigError, r"^fp_window: the FP window of 128 tokens .* does not fit the smallest budget 64"),
    ("unknown-param", "make_policy('window', budgt=3)", lambda: make_policy("window", budgt=3),
     ConfigError, r"^budgt: not a parameter of policy 'window'; its parameters are: budget, protect, sinks$"),
    ("policy-object-and-params", "make_policy(WindowPolicy(), budget=3)",
     lambda: make_policy(make_policy("window"), budget=3), ConfigError, r"either a Policy object or a name"),
    ("unknown-policy", "make_policy('lru')", lambda: make_policy("lru"), ConfigError,
     r"^policy: unknown policy 'lru'; known policies: confkv, confkv-fixed, confkv-l, confkv-r, full, h2o, kivi, "
     r"quest, random, scissorhands, snapkv, streaming, tova, window$"),
    ("cold-bits", "make_policy('confkv-r', bits=5)", lambda: make_policy("confkv-r", bits=5), ConfigError,
     r"^bits: must be one of 2, 3, 4, 8 \(KIVI-style\) or 16 \(unquantized\), got 5$"),
    ("cold-page-size", "make_policy('kivi', page_size=0)", lambda: make_policy("kivi", page_size=0), ConfigError,
     r"^page_size: must be a positive integer, got 0$"),
    ("cold-k-vs-budget", "make_policy('confkv-r', k=8, cold_budget=128)",
     lambda: make_policy("confkv-r", k=8, cold_budget=128), ConfigError,
     r"^k_high: reads 8 pages of 32 tokens, more than cold_budget=128 tokens can hold"),
    ("cold-rotation-seed", "make_policy('kivi', format='hadamard', rotation_seed=-1)",
     lambda: make_policy("kivi", format="hadamard", rotation_seed=-1), ConfigError,
     r"^rotation_seed: must be a whole number in \[0, 2\*\*63\), the seed of the Hadamard rotation's signs, got -1$"),
    ("cold-offload-dir", "make_policy('confkv-r', offload=True, offload_dir='/nonexistent')",
     lambda: make_policy("confkv-r", offload=True, offload_dir="/nonexistent"), ConfigError,
     r"^offload_dir: '/nonexistent' is not a writable directory; create it or pass another$"),
    ("unsupported-arch", "ConfKVCache.for_model(<tiny OPT>)", lambda: ConfKVCache.for_model(_opt_model(), "confkv"),
     UnsupportedModelError, r"does not support model_type='opt'; supported architectures: llama"),
    ("empty-prompt-prefill", "prefill(m, cache, ids[:, :0])",
     lambda: prefill(_model(), _window_cache(_model()), _ids(0)), ValueError, r"an empty prompt cannot be continued"),
    ("empty-prompt-generate", "confkv.hf.generate(m, ids[:, :0], cache)",
     lambda: generate(_model(), _ids(0), _window_cache(_model()), max_new_tokens=2), ValueError,
     r"an empty prompt cannot be continued"),
    ("one-token-ppl", "streaming_ppl(m, ids[:, :1])",
     lambda: __import__("confkv.eval.quality.ppl", fromlist=["x"]).streaming_ppl(_model(), _ids(1), progress=False),
     ValueError, r"must be \[1, N\] with N >= 2"),
    ("zero-tokens-corpus", "corpus_tokens(tok, 'pydoc-topics', 0)",
     lambda: __import__("confkv.data", fromlist=["x"]).corpus_tokens(tiny_tokenizer(), "pydoc-topics", 0),
     ValueError, r"n_tokens must be >= 1"),
    ("ids-float", "prefill(m, cache, ids.float())", lambda: prefill(_model(), _window_cache(_model()), _ids(5).float()),
     ValueError, r"must hold integer token ids"),
    ("ids-vocab", "prefill(m, cache, ids + 1000)", lambda: prefill(_model(), _window_cache(_model()), _ids(5) + 1000),
     ValueError, r"outside the model's vocabulary \[0, 260\)"),
    ("mask-shape", "prefill(m, cache, ids[1x10], mask[1x5])",
     lambda: prefill(_model(), _window_cache(_model()), _ids(10), torch.ones(1, 5, dtype=torch.long)),
     ValueError, r"attention_mask must be \[batch, cached \+ new tokens\] = \(1, 10\)"),
    ("chunk-zero", "prefill(m, cache, ids, chunk=0)", lambda: prefill(_model(), _window_cache(_model()), _ids(5), chunk=0),
     ValueError, r"chunk must be a positive integer"),
    ("too-long-generate", "generate(gpt2 (1024 positions), 1030 tokens, max_new_tokens=3)",
     lambda: generate(_model("gpt2"), _ids(1030), _window_cache(_model("gpt2")), max_new_tokens=3),
     PromptTooLongError, r"prompt of 1030 tokens \+ 3 new tokens exceeds the model's 1024 positions"),
    ("too-long-prefill", "prefill(gpt2, cache, 1030 tokens)",
     lambda: prefill(_model("gpt2"), _window_cache(_model("gpt2")), _ids(1030)),
     PromptTooLongError, r"a sequence of 1030 tokens exceeds the model's 1024 positions"),
    ("too-long-ppl", "streaming_ppl(gpt2, 1030 tokens)",
     lambda: __import__("confkv.eval.quality.ppl", fromlist=["x"]).streaming_ppl(_model("gpt2"), _ids(1030), progress=False),
     PromptTooLongError, r"a sequence of 1030 tokens exceeds the model's 1024 positions; shorten it"),
    ("too-long-niah", "check_niah_positions(gpt2, lengths=(1024,), max_new_tokens=10)",
     lambda: __import__("confkv.eval.niah", fromlist=["x"]).check_niah_positions(_model("gpt2"), (1024,), 10),
     PromptTooLongError, r"NIAH length 1024 \+ 10 answer tokens exceeds the model's 1024 positions; use --lengths up to 1014"),
    ("model-missing", "load_model('/nonexistent/model')", lambda: load_model("/nonexistent/model"),
     ModelLoadError, r"model path /nonexistent/model does not exist\. Pass an existing model directory"),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_simple_rows(row):
    _, _, call, error, pattern = row
    with pytest.raises(error) as info:
        call()
    assert re.search(pattern, str(info.value)), str(info.value)


# --------------------------------------------------------------------------- rows with files

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", seed=7).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _copy_model(model_dir: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    return target


@pytest.mark.parametrize("damage, pattern", [
    ("truncate", r"could not load the model in .*SafetensorError.*the weight files may be missing or corrupt"),
    ("empty", r"could not load the model in .*header too small"),
    ("delete", r"could not load the model in .*no file named model\.safetensors"),
    ("config", r"could not load the model in .*not a valid JSON file"),
])
def test_model_file_corrupt_or_missing(model_dir, tmp_path, damage, pattern):
    path = _copy_model(model_dir, tmp_path)
    weights = path / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "empty":
        weights.write_bytes(b"")
    elif damage == "delete":
        weights.unlink()
    else:
        (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=pattern):
        load_model(str(path))


def test_model_file_corrupt_gguf_and_wrong_kind(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00" + b"\x00" * 20)
    with pytest.raises(ModelLoadError, match=r"could not read GGUF file .*bad\.gguf"):
        load_model(str(bad))
    text = tmp_path / "weights.txt"
    text.write_text("hello")
    with pytest.raises(ModelLoadError, match=r"is a file but not a \.gguf file"):
        load_model(str(text))


@pytest.mark.parametrize("case, pattern", [
    ("missing", r"corpus file .*/nope\.txt does not exist"),
    ("under-file", r"corpus file .*/file\.txt/sub\.txt does not exist"),
    ("directory", r"is a directory, not a text file"),
    ("unreadable", r"is not readable: Permission denied"),
    ("binary", r"looks binary \(contains NUL bytes\)"),
    ("latin1", r"is not UTF-8 text \(invalid continuation byte at byte 3\)"),
    ("empty", r"corpus file .* is empty"),
    ("unknown-name", r"unknown corpus 'no-such-corpus': not a built-in"),
])
def test_corpus_file_errors(tmp_path, case, pattern):
    from confkv.data import CorpusError, load_corpus

    regular = tmp_path / "file.txt"
    regular.write_text("hello")
    path = {"missing": tmp_path / "nope.txt", "under-file": regular / "sub.txt", "directory": tmp_path,
            "unreadable": regular, "binary": tmp_path / "b.bin", "latin1": tmp_path / "l.txt",
            "empty": tmp_path / "e.txt", "unknown-name": "no-such-corpus"}[case]
    (tmp_path / "b.bin").write_bytes(b"\x00\x01\xff")
    (tmp_path / "l.txt").write_bytes(b"caf\xe9 au lait")
    (tmp_path / "e.txt").write_text("  \n")
    if case == "unreadable":  # tests run as root: chmod 000 would still be readable, so simulate EACCES
        with mock.patch.object(Path, "read_bytes", side_effect=PermissionError(13, "Permission denied")):
            with pytest.raises(CorpusError, match=pattern):
                load_corpus(str(path))
        return
    with pytest.raises(CorpusError, match=pattern):
        load_corpus(str(path))


def test_corpus_too_short(tmp_path):
    from confkv.data import CorpusError, corpus_tokens

    text = tmp_path / "short.txt"
    text.write_text("hello")
    with pytest.raises(CorpusError, match=r"has 5 tokens with this tokenizer; requested 100 tokens"):
        corpus_tokens(tiny_tokenizer(), str(text), 100)


# --------------------------------------------------------------------------- legal but unusual

@pytest.mark.parametrize("name", ["window", "streaming", "h2o", "confkv", "confkv-l"])
def test_budget_larger_than_context_is_exact(name):
    """A budget larger than the whole sequence: no eviction, logits equal to the full cache."""
    model = _model()
    params = {"budget": 4000} if name in ("window", "streaming", "h2o") else {"n_high": 4000, "n_low": 8000}
    ids = _ids(30, batch=2, seed=3)
    with torch.no_grad():
        reference = model(ids).logits[:, -1]
    cache = ConfKVCache.for_model(model, name, **params)
    logits = prefill(model, cache, ids, chunk=7)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
    assert (cache.kept_counts() == 30).all()
    out = generate(model, ids, ConfKVCache.for_model(model, name, **params), max_new_tokens=5, do_sample=False,
                   pad_token_id=258)
    ref = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=258)
    assert torch.equal(out, ref)


def _nan_for_row(model, row: int, value: float = float("nan")):
    """Make the LM head emit ``value`` logits for batch row ``row`` (hook runs before confkv's)."""
    def hook(module, inputs, output):
        output = output.clone()
        output[row] = value
        return output
    return model.get_output_embeddings().register_forward_hook(hook, prepend=True)


def test_nan_logits_warn_low_confidence_no_crash():
    model = tiny_model("llama", seed=7)
    cache = ConfKVCache.for_model(model, "confkv", n_high=8, n_low=16, protect=2, sinks=1, tau=0.001)
    handle = _nan_for_row(model, 1)
    ids = _ids(6, batch=2)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                for t in range(6):
                    model(ids[:, t:t + 1], cache=cache, use_cache=True)
    finally:
        handle.remove()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("NaN logits in 1 sequence(s); treating them as low confidence (c=0)" in m for m in messages), messages
    record = cache.trace.steps[-1]
    assert float(record.confidence[1]) == 0.0 and float(record.confidence[0]) > 0.0
    assert float(record.confidence[0]) >= 0.001
    assert record.budget.tolist() == [8, 16]  # the healthy row is confident, the NaN row gets the loose budget
    # the other sequence's cache is untouched by the NaN row: its K/V are finite
    for layer in cache.layers:
        assert torch.isfinite(layer.store.recent.keys[0]).all()


def test_inf_logits_are_a_point_mass():
    """+inf logits: the distribution is uniform over the +inf tokens, whatever the finite ones say.

    Expected confidences from the formula (weights 0.4 / 0.3 / 0.3, centered margin), by hand:
    one +inf token -> entropy 0, margin +inf, p1 = 1 -> c = 1; a whole row of +inf (vocab V) ->
    uniform: 1 - H/log V = 0, margin 0, p1 = 1/V -> c = 0.3 / V.
    """
    model = tiny_model("llama", seed=7)
    vocab = model.config.vocab_size

    def hook(module, inputs, output):
        output = output.clone()
        output[0, :, 5] = float("inf")  # one +inf token among the model's finite logits
        output[1] = float("inf")  # every token +inf
        return output

    cache = ConfKVCache.for_model(model, "confkv", n_high=8, n_low=16, protect=2, sinks=1, tau=0.5)
    handle = model.get_output_embeddings().register_forward_hook(hook, prepend=True)
    try:
        with torch.no_grad():
            model(_ids(4, batch=2), cache=cache, use_cache=True)
    finally:
        handle.remove()
    record = cache.trace.steps[-1]
    assert float(record.confidence[0]) == pytest.approx(1.0, abs=1e-6)
    assert float(record.confidence[1]) == pytest.approx(0.3 / vocab, abs=1e-6)
    assert record.budget.tolist() == [8, 16]  # the one-hot row is confident, the uniform one is not


# --------------------------------------------------------------------------- output paths (fail fast)

@pytest.mark.parametrize("command", [
    ["ppl", "--tokens", "30", "--out", "{file}/sub/r.json"],
    ["ppl", "--tokens", "30", "--plot", "{file}/p.png"],
    ["ppl", "--tokens", "30", "--out", "{dir}"],
    ["sweep", "--tokens", "30", "--out", "{file}/sub/rows.jsonl"],
    ["sweep", "--tokens", "30", "--traces-dir", "{file}/traces"],
    ["probe", "--tokens", "30", "--out-dir", "{file}/sub"],
    ["niah", "--out-dir", "{file}"],
])
def test_unwritable_results_fail_fast(model_dir, tmp_path, capsys, command):
    from confkv.cli import main

    regular = tmp_path / "somefile.txt"
    regular.write_text("x")
    argv = [a.format(file=regular, dir=tmp_path) for a in command] + ["--model", str(model_dir)]
    with mock.patch("confkv.models.load_model", side_effect=AssertionError("loaded a model before checking --out")):
        started = time.perf_counter()
        assert main(argv) == 2
    assert time.perf_counter() - started < 5
    err = capsys.readouterr().err
    assert re.search(r"confkv: error: (cannot write|--out .* is a folder|--out-dir folder .* is a file)", err), err
    assert "somefile.txt" in err or str(tmp_path) in err


def test_unwritable_sweep_output_api(tmp_path):
    from confkv.eval.quality.sweep import SweepConfig, run_sweep
    from confkv.outputs import OutputPathError

    regular = tmp_path / "somefile.txt"
    regular.write_text("x")
    with pytest.raises(OutputPathError, match=r"somefile\.txt is a file, not a folder"):
        run_sweep(SweepConfig(), regular / "rows.jsonl", model=object(), tokenizer=object())


# --------------------------------------------------------------------------- interruption and resume

class _InterruptAfter:
    """Wrap ``model.forward`` to raise KeyboardInterrupt on call ``n + 1`` (counting from ``armed``)."""

    def __init__(self, model, n: int) -> None:
        self.model, self.n, self.calls = model, n, 0
        self.original = model.forward
        model.forward = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls > self.n:
            raise KeyboardInterrupt
        return self.original(*args, **kwargs)

    def remove(self) -> None:
        del self.model.forward


def test_streaming_ppl_interrupt_keeps_partial():
    from confkv.eval.quality.ppl import RunInterrupted, streaming_ppl

    model = tiny_model("llama", seed=7)
    patch = _InterruptAfter(model, 12)
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            streaming_ppl(model, _ids(40), "window", budget=8, protect=0, progress=False)
    finally:
        patch.remove()
    assert isinstance(info.value, RunInterrupted)
    partial = info.value.partial
    assert partial.interrupted and partial.tokens == 12 and len(partial.trace) == 12
    full = streaming_ppl(model, _ids(40), "window", budget=8, protect=0, progress=False)
    assert torch.equal(partial.nll, full.nll[:12])  # the tokens done are exactly the uninterrupted run's


def test_ppl_cli_ctrl_c_writes_valid_partial_json(model_dir, tmp_path, capsys):
    from confkv.cli import main

    real_load = load_model

    def load(name, **kwargs):
        model, tokenizer = real_load(name, **kwargs)
        _InterruptAfter(model, 9)
        return model, tokenizer

    out = tmp_path / "ppl.json"
    with mock.patch("confkv.models.load_model", load):
        rc = main(["ppl", "--model", str(model_dir), "--policy", "window", "--param", "budget=8", "--param", "protect=0",
                   "--tokens", "40", "--out", str(out), "--plot", str(tmp_path / "ppl.png")])
    assert rc == 130
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and data["summary"]["interrupted"] is True
    assert data["summary"]["tokens"] == 9 and len(data["nll"]) == 9 and len(data["trace"]["kv_bytes"]) == 9
    assert math.isfinite(data["summary"]["ppl"])
    assert not list(tmp_path.glob("*.tmp"))
    assert "interrupted (Ctrl-C) after 9 of 39 tokens" in capsys.readouterr().err


def _sweep_config(**overrides):
    from confkv.eval.quality.sweep import SweepConfig

    base = dict(policies=("full", "window", "streaming", "confkv"), memory=(0.5,), tokens=30,
                model="tiny", policy_params={"*": {"protect": 2}, "full": {}})
    return SweepConfig(**(base | overrides))


def _keys(path):
    from confkv.eval.quality.sweep import load_rows, row_key

    return [row_key(r) for r in load_rows(path)]


def test_sweep_killed_and_resumed_no_lost_or_duplicated_rows(tmp_path):
    from confkv.eval.quality.sweep import load_rows, run_sweep

    model, tok = tiny_model("llama", seed=7), tiny_tokenizer()
    config = _sweep_config()
    reference = run_sweep(config, tmp_path / "ref.jsonl", model=model, tokenizer=tok, progress=False)
    assert len(reference) == 4

    out = tmp_path / "rows.jsonl"
    # 1) stopped after one run, 2) Ctrl-C inside the third run, 3) a torn line from a kill mid-write
    run_sweep(config, out, model=model, tokenizer=tok, progress=False, stop_after=1)
    assert len(_keys(out)) == 1
    patch = _InterruptAfter(model, 29 + 5)  # the 2nd run (29 steps) completes, the 3rd is cut after 5 steps
    try:
        with pytest.raises(KeyboardInterrupt):
            run_sweep(config, out, model=model, tokenizer=tok, progress=False)
    finally:
        patch.remove()
    assert len(_keys(out)) == 2  # the interrupted run wrote nothing
    with open(out, "a") as handle:
        handle.write('{"task": "ppl", "policy": "str')  # torn last line
    rows = run_sweep(config, out, model=model, tokenizer=tok, progress=False)
    keys = _keys(out)
    assert len(keys) == len(set(keys)) == 4, keys
    assert sorted(keys) == sorted(_keys(tmp_path / "ref.jsonl"))
    by_key = {k: r["ppl"] for k, r in zip(keys, load_rows(out))}
    for k, r in zip(_keys(tmp_path / "ref.jsonl"), reference):
        assert by_key[k] == r["ppl"]  # resumed results equal the uninterrupted sweep's
    assert len(rows) == 4
    assert run_sweep(config, out, model=model, tokenizer=tok, progress=False) == rows  # nothing left to do
    assert len(_keys(out)) == 4


def test_sweep_cli_ctrl_c_then_resume(model_dir, tmp_path, capsys):
    from confkv.cli import main

    real_load = load_model
    state = {"interrupt": True}

    def load(name, **kwargs):
        model, tokenizer = real_load(name, **kwargs)
        if state["interrupt"]:
            _InterruptAfter(model, 29 + 3)
        return model, tokenizer

    out = tmp_path / "rows.jsonl"
    argv = ["sweep", "--model", str(model_dir), "--policies", "full,window,streaming", "--memory", "0.5",
            "--tokens", "30", "--param", "*:protect=2", "--param", "full:protect=2", "--out", str(out), "--no-progress"]
    with mock.patch("confkv.models.load_model", load):
        assert main(argv) == 130
    assert "1 complete rows in" in capsys.readouterr().err and len(_keys(out)) == 1
    state["interrupt"] = False
    with mock.patch("confkv.models.load_model", load):
        assert main(argv) == 0
    keys = _keys(out)
    assert len(keys) == len(set(keys)) == 3


if __name__ == "__main__":  # print the simple rows as the Markdown table of docs/BAD_INPUT.md
    for row_id, tried, call, error, _ in ROWS:
        try:
            call()
            message = "(no error)"
        except Exception as err:  # noqa: BLE001
            message = f"`{type(err).__name__}`: {err}"
        print(f"| {row_id} | `{tried}` | {message.replace('|', '/')} |")


def test_int8_window_that_does_not_fit_fails_before_loading_the_model(model_dir, capsys):
    from confkv.cli import main

    argv = ["ppl", "--tokens", "30", "--policy", "confkv", "--param", "n_high=64", "--param", "n_low=128", "--int8",
            "--model", str(model_dir)]
    with mock.patch("confkv.models.load_model", side_effect=AssertionError("loaded a model before checking")):
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert "confkv: error: fp_window: the FP window of 128 tokens (never evicted) plus 4 sinks does not fit the " \
           "smallest budget 64; lower fp_window or raise the budget" in err, err
