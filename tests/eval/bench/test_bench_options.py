"""`confkv bench`'s options on a tiny model: dtypes, the perplexity check, the llama.cpp row (a stand-in
``llama_cpp`` module in the child process, so no package is needed; its crash) and its skip message, the CLI defaults. Structure
only: no timing is asserted."""

import json
import math

import pytest
import torch

from confkv import cli
from confkv.config import StoreConfig
from confkv.data import corpus_tokens, load_corpus
from confkv.eval.bench import run as bench
from confkv.eval.bench.llamacpp import SKIP_MESSAGE, LlamaCppRunner, describe_exit
from confkv.eval.quality.ppl import streaming_ppl
from confkv.models import tiny_model, tiny_tokenizer

SMALL = dict(budget=96, slack=0, steps=2, repeats=2, warmup=1, chunk=32, batches=[], breakdown_steps=0)


@pytest.mark.filterwarnings("ignore")
def test_each_dtype_runs_the_grid_with_labelled_rows_and_a_quality_check():
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    lines = []
    result = bench.run_bench(contexts=[48, 64], configs=["dynamic", "full", "confkv"], dtypes=["float32", "bfloat16"],
                             quality_tokens=40, llamacpp=False, model=model, tokenizer=tok, log=lines.append, **SMALL)
    assert result["dtypes"] == ["float32", "bfloat16"]
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is not converted
    for context in ("48", "64"):
        rows = {k: v for k, v in result["latency"][context].items() if not k.startswith("_")}
        assert set(rows) == {"dynamic", "full", "confkv", "dynamic@bf16", "full@bf16", "confkv@bf16"}
        assert {r["dtype"] for k, r in rows.items() if k.endswith("@bf16")} == {"bfloat16"}
        assert rows["dynamic@bf16"]["speedup_vs_dynamic"] == pytest.approx(1.0)  # its own dtype's reference
        # the store follows the model's dtype: half the bytes in bfloat16, and the same as DynamicCache
        assert rows["full@bf16"]["kv_bytes"] * 2 == rows["full"]["kv_bytes"] == rows["dynamic"]["kv_bytes"]
        assert rows["full@bf16"]["kv_bytes"] == rows["dynamic@bf16"]["kv_bytes"]
        assert rows["confkv@bf16"]["speedup_vs_llamacpp"] is None
    assert result["weight_bytes_by_dtype"]["bfloat16"] * 2 == result["weight_bytes_by_dtype"]["float32"]
    quality = result["quality"]
    expected = streaming_ppl(model, corpus_tokens(tok, "pydoc-topics", 40), "full", progress=False).ppl
    assert quality["float32"]["ppl"] == pytest.approx(expected, rel=1e-9)
    assert quality["float32"]["ratio_to_float32"] == pytest.approx(1.0) and quality["float32"]["tokens"] == 39
    assert quality["bfloat16"]["ratio_to_float32"] == pytest.approx(quality["bfloat16"]["ppl"] / expected)
    assert quality["bfloat16"]["ppl"] != expected  # really run in bfloat16
    assert any(line.startswith("[bench] quality bfloat16: perplexity") for line in lines)
    assert any("confkv@bf16" in line and "bfloat16" in line for line in lines)  # the table labels the row


FAKE_LLAMA_CPP = """
import json, os, signal, struct

__version__ = "fake"
EVENTS = os.environ["FAKE_LLAMA_EVENTS"]
CRASH_AT = int(os.environ.get("FAKE_LLAMA_CRASH_AT", "0"))


def _log(kind, value):
    with open(EVENTS, "a") as f:
        f.write(json.dumps([kind, value]) + "\\n")


GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0 = 1, 2, 8
VOCAB = 1300


class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, verbose, **options):
        self.args = dict(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads,
                         n_threads_batch=n_threads_batch, verbose=verbose, **options)
        self.n_tokens = 0
        if options.get("logits_all"):
            import numpy
            self.scores = numpy.zeros((n_ctx, VOCAB), dtype=numpy.float32)
        _log("load", self.args)

    def tokenize(self, text, add_bos=True, special=False):
        assert isinstance(text, bytes) and not add_bos
        return [1000 + b for b in text]  # its own tokenizer: not the HF token ids

    def eval(self, tokens):
        assert self.n_tokens + len(tokens) <= self.args["n_ctx"], "past n_ctx"
        assert self.n_tokens >= getattr(self, "state_cells", 0), "eval before the loaded state's end"
        if CRASH_AT and self.n_tokens + len(tokens) >= CRASH_AT:
            os.kill(os.getpid(), signal.SIGSEGV)  # as libggml-cpu once did
        if self.args.get("logits_all"):  # logits that favour the byte just read by the KV type's margin
            margin = {None: 3.0, GGML_TYPE_Q8_0: 2.5, GGML_TYPE_Q4_0: 2.0}[self.args.get("type_k")]
            for i, token in enumerate(tokens):
                self.scores[self.n_tokens + i, token] = margin
        self.input_ids[self.n_tokens:self.n_tokens + len(tokens)] = tokens
        self.n_tokens += len(tokens)
        _log("llama", list(tokens))

    def close(self):
        _log("close", self.args["n_ctx"])

    # the sequence-state calls of --llamacpp-fill f16: a float16 cache of N_EMBD channels whose keys hold
    # each cell's token and values its position; values channel-major (v_trans), as without flash attention
    @property
    def ctx(self):
        return self

    @property
    def input_ids(self):
        if not hasattr(self, "_input_ids"):
            import numpy
            self._input_ids = numpy.zeros(self.args["n_ctx"], dtype=numpy.intc)
        return self._input_ids


N_EMBD, LAYERS = 64, 2


def _f16_state(llama):
    import struct, numpy
    ids = llama.input_ids[:llama.n_tokens]
    n = len(ids)
    parts = [struct.pack("<II", 1, n)] + [struct.pack("<iIi", pos, 1, 0) for pos in range(n)]
    parts.append(struct.pack("<II", 1, LAYERS))
    keys = numpy.repeat(ids.astype(numpy.float16)[:, None], N_EMBD, axis=1)
    values = numpy.repeat(numpy.arange(n, dtype=numpy.float16)[:, None], N_EMBD, axis=1)
    for _ in range(LAYERS):
        parts += [struct.pack("<iQ", GGML_TYPE_F16, 2 * N_EMBD), keys.tobytes()]
    for _ in range(LAYERS):
        parts += [struct.pack("<iII", GGML_TYPE_F16, 2, N_EMBD), values.T.copy().tobytes()]
    return b"".join(parts)


def llama_state_seq_get_size(ctx, seq_id):
    assert seq_id == 0 and not ctx.args.get("flash_attn") and "type_k" not in ctx.args
    return len(_f16_state(ctx))


def llama_state_seq_get_data(ctx, dst, size, seq_id):
    import ctypes
    data = _f16_state(ctx)
    ctypes.memmove(dst, data, min(size, len(data)))
    return len(data)


def llama_state_seq_set_data(ctx, src, size, seq_id):
    assert seq_id == 0 and ctx.args.get("flash_attn") and ctx.args.get("type_k") is not None
    _log("state", bytes(src)[:size].hex())
    ctx.state_cells = struct.unpack_from("<I", bytes(src), 4)[0]
    return size
"""


@pytest.fixture
def fake_llama_cpp(tmp_path, monkeypatch):
    """A stand-in ``llama_cpp`` module file for the child process; returns (its folder, the events file)."""
    folder = tmp_path / "fake"
    folder.mkdir()
    (folder / "fake_llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_EVENTS", str(events))
    return str(folder), events


def _events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.filterwarnings("ignore")
def test_llamacpp_row_interleaved_in_the_same_table(monkeypatch, tmp_path, fake_llama_cpp):
    folder, events_file = fake_llama_cpp
    step = bench._Runner.step

    def hf_step(self, tokens):
        with open(events_file, "a") as f:
            f.write(json.dumps(["hf", self.label]) + "\n")
        return step(self, tokens)
    monkeypatch.setattr(bench._Runner, "step", hf_step)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(96))
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    lines = []
    result = bench.run_bench(contexts=[64, 48], configs=["dynamic", "confkv"], gguf=gguf, model=model, tokenizer=tok,
                             log=lines.append, llamacpp_module="fake_llama_cpp", llamacpp_path=(folder,), **SMALL)
    (load, args), *calls = _events(events_file)
    assert load == "load" and args["model_path"] == str(gguf)
    assert args["n_threads"] == args["n_threads_batch"] == torch.get_num_threads()
    decode_steps = 2 * (1 + 2 * 2)  # contexts x (warmup + repeats x steps)
    assert args["n_ctx"] >= 64 + decode_steps
    fed = [t for kind, tokens in calls if kind == "llama" for t in tokens]
    assert len(fed) == 64 + decode_steps // 2  # up to the last context, then its decode steps
    assert fed == [1000 + b for b in load_corpus("pydoc-topics").encode()[:len(fed)]]  # the text, in order
    llama = [tokens for kind, tokens in calls if kind == "llama"]
    assert len(llama[0]) == 48 and len(llama[6]) == 64 - 48 - 5  # prefills to each context, then single steps
    assert all(len(t) == 1 for t in llama[1:6] + llama[7:])
    # interleaved: per context, 1 warmup + 2 repeats, each a run of llama.cpp steps after the other rows' steps
    kinds = [kind if kind == "hf" else ("llama-step" if len(tokens) == 1 else "llama-prefill")
             for kind, tokens in calls]
    runs = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert runs.count("llama-step") == 2 * 3
    assert all(runs[i - 1] == "hf" for i, k in enumerate(runs) if k == "llama-step")
    for context, position in (("48", 48 + 5), ("64", 64 + 5)):
        rows = result["latency"][context]
        assert rows["llama.cpp"]["kept_tokens"] == position  # its own tokens: context + the decode steps so far
        assert rows["llama.cpp"]["speedup_vs_llamacpp"] == pytest.approx(1.0)
        assert rows["confkv"]["speedup_vs_llamacpp"] > 0 and rows["llama.cpp"]["dtype"] == "gguf"
        assert rows["llama.cpp"]["kv_bytes"] == position * bench.kv_bytes_per_token_f16(model)
        assert len(rows["llama.cpp"]["times_ms"]) == 4
    assert result["configs"]["llama.cpp"]["gguf_bytes"] == 100
    assert result["configs"]["llama.cpp"]["process"] == "child" and result["configs"]["llama.cpp"]["error"] is None
    assert any("x llama" in line for line in lines)


@pytest.mark.filterwarnings("ignore")
def test_a_prefill_in_chunks_of_n_batch(tmp_path, fake_llama_cpp):
    folder, events_file = fake_llama_cpp
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    runner = LlamaCppRunner(gguf, "x" * 300, 260, 1, 4, module="fake_llama_cpp", sys_path=(folder,), n_batch=100)
    try:
        runner.feed_to(None, 250, 0)
        assert runner.next_step(None) >= 0 and runner.fed == 251 and runner.kv_bytes() == 251 * 4
    finally:
        runner.close()
    assert [len(t) for kind, t in _events(events_file) if kind == "llama"] == [100, 100, 50, 1]


@pytest.mark.filterwarnings("ignore")
def test_a_llama_cpp_crash_ends_its_row_not_the_bench(monkeypatch, tmp_path, fake_llama_cpp):
    folder, _ = fake_llama_cpp
    monkeypatch.setenv("FAKE_LLAMA_CRASH_AT", "60")  # dies while prefilling to the second context
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    lines = []
    result = bench.run_bench(contexts=[32, 64], configs=["dynamic"], gguf=gguf, model=model, tokenizer=tok,
                             log=lines.append, llamacpp_module="fake_llama_cpp", llamacpp_path=(folder,), **SMALL)
    assert "llama.cpp" in result["latency"]["32"]
    assert "llama.cpp" not in result["latency"]["64"] and "dynamic" in result["latency"]["64"]
    error = result["configs"]["llama.cpp"]["error"]
    assert error.startswith("context 64: LlamaCppCrashed") and "killed by signal SIGSEGV" in error
    assert "feed to 64 tokens" in error
    assert result["latency"]["64"]["dynamic"]["speedup_vs_llamacpp"] is None
    assert any("llama.cpp failed, row dropped" in line for line in lines)


@pytest.mark.filterwarnings("ignore")
def test_without_llama_cpp_one_line_says_how_to_install_it(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    lines = []
    result = bench.run_bench(contexts=[48], configs=["dynamic"], gguf=gguf, model=model, tokenizer=tok,
                             log=lines.append, llamacpp_module="no_such_llama_cpp_module", **SMALL)
    assert lines.count(SKIP_MESSAGE) == 1
    assert 'pip install "confkv[llamacpp]"' in SKIP_MESSAGE and "pip install llama-cpp-python==0.3.16" in SKIP_MESSAGE
    assert "llama.cpp" not in result["latency"]["48"] and "dynamic" in result["latency"]["48"]


@pytest.mark.filterwarnings("ignore")
def test_llamacpp_rows_per_kv_type_with_their_bytes_and_perplexity(tmp_path, fake_llama_cpp):
    from confkv.eval.bench.llamacpp_worker import perplexity_from_scores

    folder, events_file = fake_llama_cpp
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    lines = []
    result = bench.run_bench(contexts=[48], configs=["dynamic"], gguf=gguf, model=model, tokenizer=tok,
                             quality_tokens=40, memory=(0.28125,), log=lines.append, llamacpp_module="fake_llama_cpp",
                             llamacpp_path=(folder,), llamacpp_kv=("f16", "q8_0", "q4_0"), **SMALL)
    loads = [args for kind, args in _events(events_file) if kind == "load"]
    timed = [a for a in loads if not a.get("logits_all")]
    assert [a.get("type_k") for a in timed] == [None, 8, 2] and [a.get("type_v") for a in timed] == [None, 8, 2]
    assert [a.get("flash_attn") for a in timed] == [None, True, True]
    scorers = [a for a in loads if a.get("logits_all")]
    assert [a["n_ctx"] for a in scorers] == [40, 40, 40] and [a.get("type_k") for a in scorers] == [None, 8, 2]
    assert [n for kind, n in _events(events_file) if kind == "close"] == [40, 40, 40]  # each scorer freed
    rows = result["latency"]["48"]
    f16 = bench.kv_bytes_per_token_f16(model)
    for label, per_32 in (("llama.cpp", 64), ("llama.cpp[q8_0]", 34), ("llama.cpp[q4_0]", 18)):
        assert rows[label]["kv_bytes"] == rows[label]["kept_tokens"] * f16 * per_32 // 64
        assert rows[label]["config"] == label and result["configs"][label]["error"] is None
    assert rows["llama.cpp[q4_0]"]["speedup_vs_llamacpp"] > 0
    # perplexity from the stand-in's logits: the byte just read gets the type's margin over 1299 zeros
    quality = result["quality"]
    text = load_corpus("pydoc-topics").encode()[:40]
    repeats = sum(text[i + 1] == text[i] for i in range(39))
    assert 0 < repeats < 39  # both kinds of prediction are scored
    for label, margin in (("llama.cpp", 3.0), ("llama.cpp[q8_0]", 2.5), ("llama.cpp[q4_0]", 2.0)):
        expected = math.exp(math.log(math.exp(margin) + 1299) - margin * repeats / 39)
        assert quality[label]["ppl"] == pytest.approx(expected, rel=1e-9) and quality[label]["tokens"] == 39
    assert quality["llama.cpp[q4_0]"]["rise_over_f16"] == pytest.approx(
        quality["llama.cpp[q4_0]"]["ppl"] / quality["llama.cpp"]["ppl"] - 1)
    assert quality["llama.cpp"]["rise_over_f16"] == 0
    ours = quality["tiered@28.125"]
    assert ours["rise_over_full"] == pytest.approx(ours["ppl"] / quality["float32"]["ppl"] - 1)
    equal = [line for line in lines if line.startswith("[bench] equal KV bytes")]
    assert len(equal) == 1 and "tiered@28.125" in equal[0] and "llama.cpp[q4_0]" in equal[0]
    # the worker's perplexity itself, on logits worked out by hand
    scores = [[0.0, 2.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    ppl, n = perplexity_from_scores(scores, [0, 1, 2])
    nll = (math.log(math.exp(2) + 2) - 2) + (math.log(math.e + 2) - 0)
    assert n == 2 and ppl == pytest.approx(math.exp(nll / 2), rel=1e-12)


@pytest.mark.filterwarnings("ignore")
def test_a_q4_0_row_filled_from_a_float16_prefill(tmp_path, fake_llama_cpp):
    """--llamacpp-fill f16: a float16 helper prefills (plain attention), its cache goes to the q4_0 context
    converted, and the q4_0 context only steps, from the position the state ends at."""
    import numpy
    from gguf import GGMLQuantizationType, quants

    from confkv.eval.bench.llamacpp_state import GGML_Q4_0, read_seq_state

    folder, events_file = fake_llama_cpp
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    lines = []
    result = bench.run_bench(contexts=[32, 48], configs=["dynamic"], gguf=gguf, model=model, tokenizer=tok,
                             log=lines.append, llamacpp_module="fake_llama_cpp", llamacpp_path=(folder,),
                             llamacpp_kv=("q4_0",), llamacpp_fill="f16", **SMALL)
    events = _events(events_file)
    loads = [args for kind, args in events if kind == "load"]
    assert [(a.get("type_k"), a.get("flash_attn")) for a in loads] == [(2, True), (None, None)]  # timed, helper
    assert loads[0]["n_ctx"] == loads[1]["n_ctx"]
    text = [1000 + b for b in load_corpus("pydoc-topics").encode()]
    evals = [tokens for kind, tokens in events if kind == "llama"]
    prefills = [t for t in evals if len(t) > 1]
    assert prefills == [text[:32], text[32:48]]  # the helper, from where it stopped; no quantized prefill
    states = [bytes.fromhex(h) for kind, h in events if kind == "state"]
    assert len(states) == 2
    for data, cells in zip(states, (32, 48)):
        (stream,) = read_seq_state(data)
        assert stream.positions.tolist() == list(range(cells)) and stream.seq_ids == [(0,)] * cells
        for (k_type, k), (v_type, v) in zip(stream.keys, stream.values):
            assert k_type == v_type == GGML_Q4_0 and k.shape == (cells, 2 * 18)
            keys = quants.dequantize(k, GGMLQuantizationType.Q4_0)
            assert numpy.array_equal(keys, numpy.repeat(numpy.float32(text[:cells])[:, None], 64, axis=1))
            values = quants.dequantize(v, GGMLQuantizationType.Q4_0)
            assert numpy.array_equal(values, numpy.repeat(numpy.arange(cells, dtype=numpy.float32)[:, None], 64, 1))
    steps = [t for t in evals if len(t) == 1]
    assert [t[0] for t in steps] == text[32:32 + len(steps) - 5] + text[48:48 + 5]  # steps go on from the state
    assert result["latency"]["48"]["llama.cpp[q4_0]"]["kept_tokens"] == 48 + 5
    assert result["configs"]["llama.cpp[q4_0]"]["fill"] == "f16"
    assert any("KV q4_0, its cache filled from a float16 prefill (converted)" in line for line in lines)


def test_an_unknown_fill_is_named():
    from confkv.errors import ConfigError
    from confkv.eval.bench.llamacpp_worker import LlamaSession

    with pytest.raises(ConfigError, match="--llamacpp-fill bf16: choose one of native, f16"):
        bench.run_bench(contexts=[48], llamacpp_fill="bf16", model=object(), tokenizer=object())
    with pytest.raises(ValueError, match="fill 'bf16': choose one of native, f16"):
        LlamaSession(object(), "model.gguf", "text", 8, 1, fill="bf16")


def test_an_unknown_llamacpp_kv_type_is_named():
    from confkv.errors import ConfigError

    with pytest.raises(ConfigError, match="--llamacpp-kv q5_1: llama.cpp KV types are f16, q8_0, q4_0"):
        bench.run_bench(contexts=[48], llamacpp_kv=("q5_1",), model=object(), tokenizer=object())


def test_exit_codes_are_described():
    assert describe_exit(-11) == "killed by signal SIGSEGV" and describe_exit(3) == "exit status 3"


def test_cli_defaults_two_threads_float32_and_a_2048_token_quality_check(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(bench, "run_bench", lambda **kw: seen.update(kw) or {"peak_rss_bytes": 0, "load": {}})
    monkeypatch.setattr("confkv.eval.bench.output.write_outputs", lambda *a: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.update(threads=n))
    assert cli.main(["bench", "--out", str(tmp_path)]) == 0
    assert seen["threads"] == 2 and seen["dtypes"] == ["float32"] and seen["quality_tokens"] == 2048
    assert seen["llamacpp"] is True and seen["llamacpp_kv"] == ("f16", "q8_0", "q4_0")
    assert cli.main(["bench", "--dtype", "float32", "bfloat16", "--quality-tokens", "0", "--no-llamacpp",
                     "--threads", "1", "--out", str(tmp_path)]) == 0
    assert seen["threads"] == 1 and seen["dtypes"] == ["float32", "bfloat16"] and seen["quality_tokens"] == 0
    assert seen["llamacpp"] is False
    with pytest.raises(SystemExit):
        cli.main(["bench", "--dtype", "float16"])


def test_bad_dtype_and_quality_tokens_name_the_option():
    from confkv.errors import ConfigError

    with pytest.raises(ConfigError, match="--dtype float16"):
        bench.run_bench(contexts=[48], dtypes=["float16"], model=object(), tokenizer=object())
    with pytest.raises(ConfigError, match="--quality-tokens 1"):
        bench.run_bench(contexts=[48], quality_tokens=1, model=object(), tokenizer=object())


@pytest.mark.filterwarnings("ignore")
def test_weight_int8_dtype_and_the_lean_row():
    """``bfloat16-w8`` quantizes a copy's linear layers (rows ``@bf16w8``); the ``-lean`` row decodes
    through the lean decoder and holds the same KV as its model(...) twin, plus the spare slots of its
    FP-window buffers (confkv/store/window_buffer.py: at most move_block + 1 per layer)."""
    from confkv.hf.weights import Int8Linear

    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    lines = []
    configs = ["dynamic", "confkv+slack8", "confkv+slack8-lean"]
    small = {**SMALL, "slack": 8}
    seen_models = []
    original = bench._Runner.__init__

    def spy(self, config, model, dtype="float32"):
        seen_models.append((dtype, model))
        original(self, config, model, dtype)

    bench._Runner.__init__ = spy
    try:
        result = bench.run_bench(contexts=[64], configs=configs, dtypes=["bfloat16", "bfloat16-w8"],
                                 quality_tokens=40, llamacpp=False, model=model, tokenizer=tok, log=lines.append,
                                 **small)
    finally:
        bench._Runner.__init__ = original
    rows = {k: v for k, v in result["latency"]["64"].items() if not k.startswith("_")}
    assert set(rows) == {f"{c}@{d}" for c in configs for d in ("bf16", "bf16w8")}
    w8 = {id(m) for d, m in seen_models if d == "bfloat16-w8"}
    bf16 = {id(m) for d, m in seen_models if d == "bfloat16"}
    assert len(w8) == 1 and not w8 & bf16
    w8_model = next(m for d, m in seen_models if d == "bfloat16-w8")
    assert any(isinstance(m, Int8Linear) for m in w8_model.modules())
    assert not any(isinstance(m, Int8Linear) for m in model.modules())  # the caller's model is untouched
    config = model.config
    slot_bytes = 2 * config.num_key_value_heads * config.head_dim * 2  # keys and values, bfloat16, one sequence
    most_spare = config.num_hidden_layers * (StoreConfig().move_block + 1) * slot_bytes
    for d in ("bf16", "bf16w8"):
        spare = rows[f"confkv+slack8-lean@{d}"]["kv_bytes"] - rows[f"confkv+slack8@{d}"]["kv_bytes"]
        assert 0 < spare <= most_spare
    quality = result["quality"]
    assert quality["bfloat16-w8"]["ppl"] != quality["bfloat16"]["ppl"]  # really quantized


def test_w8a8_dtype_quantizes_the_activations_too():
    """``bfloat16-w8a8``: INT8 weights whose inputs are quantised to int8 blocks (rows ``@bf16w8a8``), its own
    perplexity beside the others."""
    from confkv.eval.bench.dtypes import models_by_dtype, parse_dtypes, row_label
    from confkv.hf.weights import Int8Linear

    assert parse_dtypes(["bfloat16-w8a8", "float32"]) == ["bfloat16-w8a8", "float32"]
    assert row_label("confkv", "bfloat16-w8a8") == "confkv@bf16w8a8"
    model = tiny_model("llama", seed=3)
    models, _ = models_by_dtype(["bfloat16-w8", "bfloat16-w8a8"], "tiny", model, tiny_tokenizer(), None)
    bits = {name: {m.activation_bits for m in m_.modules() if isinstance(m, Int8Linear)} for name, m_ in models.items()}
    assert bits == {"bfloat16-w8": {16}, "bfloat16-w8a8": {8}}


@pytest.mark.filterwarnings("ignore")
def test_the_lean_torch_row_runs_its_steps_with_the_native_kernels_off(monkeypatch):
    """``-lean-torch`` (the A/B twin of ``-lean``) decodes every step inside ``native.loader.disabled()``;
    the ``-lean`` row never does."""
    import contextlib

    from confkv.native import loader

    entered = []

    @contextlib.contextmanager
    def recording():
        entered.append(1)
        yield

    monkeypatch.setattr(loader, "disabled", recording)
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    small = {**SMALL, "slack": 8}
    result = bench.run_bench(contexts=[64], configs=["confkv+slack8-lean"], llamacpp=False, model=model,
                             tokenizer=tok, log=lambda line: None, **small)
    assert result["latency"]["64"]["confkv+slack8-lean"]["n"] > 0 and not entered
    result = bench.run_bench(contexts=[64], configs=["confkv+slack8-lean-torch"], llamacpp=False, model=model,
                             tokenizer=tok, log=lambda line: None, **small)
    timed = result["latency"]["64"]["confkv+slack8-lean-torch"]["n"]
    assert len(entered) >= timed > 0  # every timed step (and the untimed warm-up ones)
