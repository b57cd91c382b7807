"""llama.cpp's side of the bench's peer row, runnable on its own: ``python llamacpp_worker.py``.

:class:`LlamaSession` holds one ``llama_cpp.Llama`` and the bench's text in its tokens: it
evaluates the text up to a context (in ``n_batch`` chunks), then one token per timed step.
The bench runs it in a child process (:class:`confkv.eval.bench.llamacpp.LlamaCppRunner`), so
that a crash inside llama.cpp (a segfault in ``libggml-cpu`` was seen during an 8K prefill
with two threads, torch's OpenMP runtime loaded in the same process) ends that row, not the
bench. Run as a script, this file imports nothing from confkv (nor torch): the child loads
llama.cpp alone.

Protocol (script mode): one JSON object per line on stdin, one reply per line on the
original stdout (the child's own stdout is pointed at stderr, so that anything llama.cpp
prints cannot corrupt the replies). Requests: ``{"op": "load", "module": "llama_cpp",
"sys_path": [...], "gguf": ..., "text": ..., "n_ctx": ..., "threads": ..., "n_batch": ...}``,
``{"op": "feed", "target": N}``, ``{"op": "step"}``, ``{"op": "perplexity", "tokens": N}``,
``{"op": "close"}``. ``load`` may name ``"kv_type"`` (``"f16"``, llama.cpp's default, or ``"q8_0"`` /
``"q4_0"``: keys and values stored in that block format, flash attention on, as llama.cpp's
``--cache-type-k/v`` with ``-fa``), and ``"fill": "f16"``: such a row's cache reaches each context
from a float16 prefill, converted to its block format (:mod:`llamacpp_state`, which says why).
Replies: ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import sys
import time
from typing import Any

#: KV cache types the row takes: name -> (ggml type attribute of ``llama_cpp``, bytes per 32 values).
#: q8_0: 32 int8 + one float16 scale; q4_0: 32 four-bit codes + one float16 scale (ggml's block layouts).
KV_TYPES = {"f16": ("GGML_TYPE_F16", 64), "q8_0": ("GGML_TYPE_Q8_0", 34), "q4_0": ("GGML_TYPE_Q4_0", 18)}
#: how a quantized row's cache reaches a context (:class:`LlamaSession`'s ``fill``)
FILLS = ("native", "f16")


def kv_options(llama_cpp: Any, kv_type: str) -> dict[str, Any]:
    """``Llama`` keyword arguments for ``kv_type``: none for f16 (llama.cpp's default cache), else
    ``type_k = type_v =`` its ggml type with ``flash_attn=True`` (llama.cpp quantizes V only with it)."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"llama.cpp KV type {kv_type!r}: choose one of {sorted(KV_TYPES)}")
    if kv_type == "f16":
        return {}
    ggml_type = getattr(llama_cpp, KV_TYPES[kv_type][0])
    return {"type_k": ggml_type, "type_v": ggml_type, "flash_attn": True}


def perplexity_from_scores(scores: Any, tokens: list[int]) -> tuple[float, int]:
    """exp(mean NLL) of ``tokens[1:]`` under ``scores[:-1]`` ([len(tokens), vocab] logits, float64 sums);
    returns (perplexity, predictions)."""
    import numpy as np

    logits = np.asarray(scores[:len(tokens) - 1], dtype=np.float64)
    top = logits.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    targets = np.asarray(tokens[1:], dtype=np.int64)
    nll = log_norm - logits[np.arange(len(targets)), targets]
    return float(np.exp(nll.mean())), len(targets)


class LlamaSession:
    """A ``Llama`` over the bench's text: ``feed_to`` a context, then timed single-token ``step``s.

    Args:
        llama_cpp: the ``llama_cpp`` module (a stand-in in the tests).
        gguf: path of the GGUF file.
        text: the text, tokenized here with the GGUF's own tokenizer (no BOS).
        n_ctx: llama.cpp's context size (the largest context plus every decode step).
        threads: ``n_threads`` and ``n_threads_batch``.
        n_batch: tokens per ``eval`` call while prefilling (llama.cpp's batch).
        kv_type: the KV cache's type (:data:`KV_TYPES`).
        fill: how a quantized cache reaches a context: ``"native"`` (llama.cpp's own prefill with that
            cache) or ``"f16"`` (a second ``Llama`` with the float16 cache, llama.cpp's default attention,
            prefills the same tokens; its cache is converted to ``kv_type`` and loaded into the timed
            context, :func:`fill_from_f16`). The timed steps are the same either way.
    """

    def __init__(self, llama_cpp: Any, gguf: str, text: str, n_ctx: int, threads: int, n_batch: int = 512,
                 kv_type: str = "f16", fill: str = "native") -> None:
        if fill not in FILLS:
            raise ValueError(f"fill {fill!r}: choose one of {', '.join(FILLS)}")
        self.module, self.gguf, self.threads, self.kv_type = llama_cpp, str(gguf), threads, kv_type
        self.fill = "native" if kv_type == "f16" else fill
        self.n_ctx = n_ctx
        self.helper: Any = None  # the float16 Llama of fill="f16", kept between contexts
        self.helper_fed = 0
        self.llama = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads,
                                     n_threads_batch=threads, verbose=False, **kv_options(llama_cpp, kv_type))
        self.tokens = list(self.llama.tokenize(text.encode("utf-8"), add_bos=False))
        if len(self.tokens) < n_ctx:
            raise ValueError(f"the bench's text has {len(self.tokens)} tokens with the GGUF's tokenizer; "
                             f"the llama.cpp row needs {n_ctx}: pass a longer --corpus or smaller --contexts")
        self.fed = 0
        self.n_batch = n_batch
        self.version = getattr(llama_cpp, "__version__", None)

    def feed_to(self, target: int) -> int:
        """Evaluate the text up to ``target`` tokens, ``n_batch`` at a time; returns the tokens fed."""
        if self.fill == "f16" and self.fed < target:
            return self.fill_from_f16(target)
        while self.fed < target:
            end = min(target, self.fed + self.n_batch)
            self.llama.eval(self.tokens[self.fed:end])
            self.fed = end
        return self.fed

    def fill_from_f16(self, target: int) -> int:
        """Reach ``target`` tokens through the float16 helper: it evaluates the text up to ``target``
        (``n_batch`` at a time, from where it stopped), its sequence's cache is converted to
        ``kv_type`` and replaces the timed context's (``llama_state_seq_set_data``); the ``Llama``'s
        own count of tokens is set to match, so its next ``eval`` goes on at position ``target``."""
        if __package__:
            from confkv.eval.bench import llamacpp_state  # noqa: PLC0415
        else:  # the child, started by path: the module beside this file
            import llamacpp_state  # noqa: PLC0415

        if self.helper is None:
            self.helper = self.module.Llama(model_path=self.gguf, n_ctx=self.n_ctx, n_threads=self.threads,
                                            n_threads_batch=self.threads, verbose=False)
        while self.helper_fed < target:
            end = min(target, self.helper_fed + self.n_batch)
            self.helper.eval(self.tokens[self.helper_fed:end])
            self.helper_fed = end
        api = self.module
        size = api.llama_state_seq_get_size(self.helper.ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        if api.llama_state_seq_get_data(self.helper.ctx, buffer, size, 0) != size:
            raise RuntimeError(f"llama.cpp wrote a float16 state of other than {size} bytes")
        converted = llamacpp_state.convert_f16_state(memoryview(buffer), self.kv_type)
        source = (ctypes.c_uint8 * len(converted)).from_buffer_copy(converted)
        if api.llama_state_seq_set_data(self.llama.ctx, source, len(converted), 0) != len(converted):
            raise RuntimeError(f"llama.cpp did not load the {self.kv_type} state converted from float16 "
                               "(its log, on stderr, says why)")
        self.llama.n_tokens = target
        self.llama.input_ids[:target] = self.tokens[:target]
        self.fed = target
        return self.fed

    def close(self) -> None:
        """Free the float16 helper of ``fill="f16"``, if any."""
        close = getattr(self.helper, "close", None)
        if close is not None:
            close()
        self.helper = None

    def step(self) -> float:
        """One decode step, the text's next token; returns seconds."""
        token = self.tokens[self.fed]
        start = time.perf_counter()
        self.llama.eval([token])
        elapsed = time.perf_counter() - start
        self.fed += 1
        return elapsed

    def perplexity(self, count: int) -> tuple[float, int]:
        """Perplexity of the text's first ``count`` tokens from llama.cpp's own logits, in a second
        ``Llama`` (``n_ctx = count``, every position's logits kept, the same KV type), freed after;
        returns (perplexity, predictions = count - 1). The timed session is left as it was."""
        if not 2 <= count <= len(self.tokens):
            raise ValueError(f"perplexity over {count} tokens: the text has {len(self.tokens)} (at least 2 needed)")
        scorer = self.module.Llama(model_path=self.gguf, n_ctx=count, n_threads=self.threads,
                                   n_threads_batch=self.threads, verbose=False, logits_all=True,
                                   n_batch=min(self.n_batch, count), **kv_options(self.module, self.kv_type))
        try:
            for start in range(0, count, self.n_batch):
                scorer.eval(self.tokens[start:min(count, start + self.n_batch)])
            return perplexity_from_scores(scorer.scores, self.tokens[:count])
        finally:
            close = getattr(scorer, "close", None)
            if close is not None:
                close()


def serve(requests: Any, replies: Any) -> None:
    """Answer the protocol's requests (file-like, one JSON object per line) until ``close`` or EOF."""
    session: LlamaSession | None = None
    for line in requests:
        request = json.loads(line)
        op = request.get("op")
        try:
            if op == "close":
                if session is not None:
                    session.close()
                reply: dict[str, Any] = {"ok": True}
            elif op == "load":
                sys.path[:0] = request.get("sys_path", [])
                module = importlib.import_module(request.get("module", "llama_cpp"))
                session = LlamaSession(module, request["gguf"], request["text"], request["n_ctx"],
                                       request["threads"], request.get("n_batch", 512),
                                       request.get("kv_type", "f16"), request.get("fill", "native"))
                reply = {"ok": True, "tokens": len(session.tokens), "version": session.version}
            elif session is None:
                reply = {"ok": False, "error": f"{op!r} before 'load'"}
            elif op == "feed":
                reply = {"ok": True, "fed": session.feed_to(int(request["target"]))}
            elif op == "step":
                reply = {"ok": True, "seconds": session.step(), "fed": session.fed}
            elif op == "perplexity":
                ppl, predictions = session.perplexity(int(request["tokens"]))
                reply = {"ok": True, "ppl": ppl, "tokens": predictions}
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as error:  # noqa: BLE001 - reported to the parent, which logs it
            reply = {"ok": False, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
        if op == "close":
            return


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # llama.cpp's own prints go to stderr, never into the replies
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
