"""``confkv bench --dtype``: the model in each dtype, row labels, and the perplexity check beside each dtype.

The whole latency grid runs once per dtype with the model loaded in that dtype (confkv's
store keeps keys and values in the dtype the model hands it; its statistics stay float32).
Rows of float32 keep the configuration's name (``confkv``), rows of another dtype carry it
(``confkv@bf16``); every row also records its ``dtype``. ``bfloat16-w8`` is the bfloat16 model with
weight-only INT8 linear layers (:func:`confkv.hf.weights.quantize_linear_weights`; rows
``confkv@bf16w8``); ``bfloat16-w8a8`` also quantises each projection's input to int8 in blocks of 32
(W8A8, llama.cpp's Q8_0 activations; rows ``confkv@bf16w8a8``).

Quality: streaming perplexity (:func:`confkv.eval.quality.ppl.streaming_ppl`, policy ``full``) of
the first ``quality_tokens`` tokens of the bench's text, per dtype, with its ratio to
float32's, so that a faster dtype never hides a quality loss.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch

from confkv.errors import ConfigError

#: ``--dtype`` names -> (torch dtype, short label)
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "fp32"),
    "bfloat16": (torch.bfloat16, "bf16"),
    # bfloat16 activations and KV, weight-only INT8 linear layers (confkv.hf.weights)
    "bfloat16-w8": (torch.bfloat16, "bf16w8"),
    # the same with the projections' inputs quantised to int8 blocks (W8A8: integer products in the GEMV)
    "bfloat16-w8a8": (torch.bfloat16, "bf16w8a8"),
    # 4-bit weight blocks with int8 activation blocks (W4A8, confkv.hf.weights.Int4Linear: half W8's weight bytes)
    "bfloat16-w4a8": (torch.bfloat16, "bf16w4a8"),
}

#: ``--dtype`` names whose linear weights are quantized after loading -> (activation bits, weight bits)
WEIGHT_INT8 = {"bfloat16-w8": (16, 8), "bfloat16-w8a8": (8, 8), "bfloat16-w4a8": (8, 4)}


def parse_dtypes(names: list[str] | tuple[str, ...] | None) -> list[str]:
    """``names`` checked and deduplicated in order (default: float32).

    Raises:
        ConfigError: an unknown name (names the option and the allowed values).
    """
    names = list(names or ["float32"])
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        raise ConfigError(f"--dtype {' '.join(unknown)}: unknown; use one or more of {', '.join(DTYPES)}")
    return list(dict.fromkeys(names))


def row_label(config: str, dtype: str) -> str:
    """The row name of ``config`` run in ``dtype``: the bare name for float32, else ``name@short``."""
    return config if dtype == "float32" else f"{config}@{DTYPES[dtype][1]}"


def models_by_dtype(dtypes: list[str], model_name: str, model: Any, tokenizer: Any,
                    load: Callable[..., tuple[Any, Any]]) -> tuple[dict[str, Any], Any]:
    """One model per dtype: loaded by ``load(model_name, dtype=...)``, or, when ``model`` is given,
    ``model`` itself for its own dtype and a converted copy for the others."""
    models: dict[str, Any] = {}
    for name in dtypes:
        dtype = DTYPES[name][0]
        if model is None:
            models[name], loaded_tokenizer = load(model_name, dtype=dtype)
            tokenizer = tokenizer or loaded_tokenizer
        elif next(model.parameters()).dtype == dtype:
            models[name] = model
        else:
            models[name] = copy.deepcopy(model).to(dtype)
        if name in WEIGHT_INT8:
            from confkv.hf.weights import quantize_linear_weights  # noqa: PLC0415

            if models[name] is model:
                models[name] = copy.deepcopy(model)
            activation_bits, weight_bits = WEIGHT_INT8[name]
            quantize_linear_weights(models[name], activation_bits=activation_bits, weight_bits=weight_bits)
    return models, tokenizer


def quality_check(models: dict[str, Any], ids: torch.Tensor, tokens: int,
                  log: Callable[[str], None], memory: tuple[float, ...] = ()) -> dict[str, Any]:
    """Streaming perplexity (policy ``full``) of ``ids[:, :tokens]`` per dtype, and its ratio to float32's;
    with ``memory``, also the memory preset's at each target (the rows ``tiered@<percent>``).

    Args:
        models: dtype name -> model.
        ids: [1, N] the bench's text, N >= ``tokens``.
        tokens: how many tokens (>= 2).
        memory: targets of the preset (fractions of the full cache's bytes, held at every step).
    Returns:
        dtype name -> {"tokens" (scored), "ppl", "ratio_to_float32" (None without a float32 run), "seconds"};
        and per preset row (:func:`row_label` of ``tiered@<percent>`` in that dtype) {"tokens", "ppl",
        "seconds", "memory", "dtype", "rise_over_full"} (its perplexity over that dtype's full cache's, minus 1).
    """
    from confkv.eval.quality.ppl import streaming_ppl  # noqa: PLC0415 - needs transformers

    out: dict[str, Any] = {}
    for name, model in models.items():
        start = time.perf_counter()
        result = streaming_ppl(model, ids[:, :tokens], "full", progress=False)
        out[name] = {"tokens": result.tokens, "ppl": result.ppl, "seconds": time.perf_counter() - start}
    reference = out.get("float32", {}).get("ppl")
    for name, row in out.items():
        row["ratio_to_float32"] = row["ppl"] / reference if reference else None
        ratio = f" = {row['ratio_to_float32']:.4f}x float32" if row["ratio_to_float32"] else ""
        log(f"[bench] quality {name}: perplexity {row['ppl']:.4f} over the first {tokens} tokens "
            f"(streaming, policy full){ratio}")
    if reference is None:
        log("[bench] quality: no float32 run, so no ratio to float32 (add float32 to --dtype)")
    for name, model in models.items():
        for fraction in memory:
            label = row_label(f"tiered@{fraction * 100:g}", name)
            start = time.perf_counter()
            result = streaming_ppl(model, ids[:, :tokens], "tiered", progress=False, memory=fraction)
            rise = result.ppl / out[name]["ppl"] - 1
            out[label] = {"tokens": result.tokens, "ppl": result.ppl, "seconds": time.perf_counter() - start,
                          "memory": fraction, "dtype": name, "rise_over_full": rise}
            log(f"[bench] quality {label}: perplexity {result.ppl:.4f} over the first {tokens} tokens "
                f"(streaming, the memory preset at {fraction:g}): {rise:+.2%} over full in {name}")
    return out


def check_quality_tokens(tokens: int) -> None:
    """Raises ConfigError unless ``tokens`` is 0 (skip) or >= 2."""
    if tokens == 1 or tokens < 0:
        raise ConfigError(f"--quality-tokens {tokens}: use 0 to skip the perplexity check, or at least 2 tokens")
