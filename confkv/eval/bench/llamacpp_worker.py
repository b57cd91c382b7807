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
``{"op": "feed", "target": N}``, ``{"op": "step"}``, ``{"op": "close"}``. Replies:
``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any


class LlamaSession:
    """A ``Llama`` over the bench's text: ``feed_to`` a context, then timed single-token ``step``s.

    Args:
        llama_cpp: the ``llama_cpp`` module (a stand-in in the tests).
        gguf: path of the GGUF file.
        text: the text, tokenized here with the GGUF's own tokenizer (no BOS).
        n_ctx: llama.cpp's context size (the largest context plus every decode step).
        threads: ``n_threads`` and ``n_threads_batch``.
        n_batch: tokens per ``eval`` call while prefilling (llama.cpp's batch).
    """

    def __init__(self, llama_cpp: Any, gguf: str, text: str, n_ctx: int, threads: int, n_batch: int = 512) -> None:
        self.llama = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads,
                                     n_threads_batch=threads, verbose=False)
        self.tokens = list(self.llama.tokenize(text.encode("utf-8"), add_bos=False))
        if len(self.tokens) < n_ctx:
            raise ValueError(f"the bench's text has {len(self.tokens)} tokens with the GGUF's tokenizer; "
                             f"the llama.cpp row needs {n_ctx}: pass a longer --corpus or smaller --contexts")
        self.fed = 0
        self.n_batch = n_batch
        self.version = getattr(llama_cpp, "__version__", None)

    def feed_to(self, target: int) -> int:
        """Evaluate the text up to ``target`` tokens, ``n_batch`` at a time; returns the tokens fed."""
        while self.fed < target:
            end = min(target, self.fed + self.n_batch)
            self.llama.eval(self.tokens[self.fed:end])
            self.fed = end
        return self.fed

    def step(self) -> float:
        """One decode step, the text's next token; returns seconds."""
        token = self.tokens[self.fed]
        start = time.perf_counter()
        self.llama.eval([token])
        elapsed = time.perf_counter() - start
        self.fed += 1
        return elapsed


def serve(requests: Any, replies: Any) -> None:
    """Answer the protocol's requests (file-like, one JSON object per line) until ``close`` or EOF."""
    session: LlamaSession | None = None
    for line in requests:
        request = json.loads(line)
        op = request.get("op")
        try:
            if op == "close":
                reply: dict[str, Any] = {"ok": True}
            elif op == "load":
                sys.path[:0] = request.get("sys_path", [])
                module = importlib.import_module(request.get("module", "llama_cpp"))
                session = LlamaSession(module, request["gguf"], request["text"], request["n_ctx"],
                                       request["threads"], request.get("n_batch", 512))
                reply = {"ok": True, "tokens": len(session.tokens), "version": session.version}
            elif session is None:
                reply = {"ok": False, "error": f"{op!r} before 'load'"}
            elif op == "feed":
                reply = {"ok": True, "fed": session.feed_to(int(request["target"]))}
            elif op == "step":
                reply = {"ok": True, "seconds": session.step(), "fed": session.fed}
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
