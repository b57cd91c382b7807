"""Tiny randomly initialised test models and a byte-level tokenizer, built locally (no files)."""

from __future__ import annotations

from typing import Any

import torch

SUPPORTED_TINY_ARCHS: tuple[str, ...] = ("llama", "qwen2", "mistral", "gpt2", "gemma3")

# 256 byte tokens + <s>, </s>, <pad>; the tiny models get a few spare ids.
TINY_VOCAB_SIZE = 260
_TINY_BOS, _TINY_EOS, _TINY_PAD = 256, 257, 258


def _tiny_config(arch: str, overrides: dict[str, Any]) -> Any:
    import transformers as tf

    special = {"bos_token_id": _TINY_BOS, "eos_token_id": _TINY_EOS, "pad_token_id": _TINY_PAD}
    common = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        **special,
    }
    if arch == "llama":
        return tf.LlamaConfig(**{**common, **overrides})
    if arch == "qwen2":
        return tf.Qwen2Config(**{**common, **overrides})
    if arch == "mistral":
        return tf.MistralConfig(**{**common, "sliding_window": None, **overrides})
    if arch == "gemma3":
        kwargs = {
            **common,
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 16,
        }
        kwargs.update(overrides)
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            n = kwargs["num_hidden_layers"]
            kwargs["layer_types"] = ["full_attention" if i % 2 else "sliding_attention" for i in range(n)]
        return tf.Gemma3TextConfig(**kwargs)
    if arch == "gpt2":
        kwargs = {"vocab_size": TINY_VOCAB_SIZE, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 1024, **special}
        return tf.GPT2Config(**{**kwargs, **overrides})
    raise ValueError(f"unknown tiny arch {arch!r}; choose one of {SUPPORTED_TINY_ARCHS}")


#: the widths of ``tiny_model(..., asymmetric=True)``: hidden 40 (not a multiple of 16), 4 query heads / 2 KV
#: heads of dim 16 (so ``head_dim * heads`` = 64 != hidden), MLP 72; GPT-2 derives its head size (40 / 4 = 10)
ASYMMETRIC_SHAPE: dict[str, Any] = {"hidden_size": 40, "head_dim": 16, "intermediate_size": 72}
_ASYMMETRIC_GPT2 = {"n_embd": 40}


def tiny_model(arch: str, *, seed: int = 0, asymmetric: bool = False, **config_overrides: Any) -> Any:
    """A tiny randomly initialised causal LM of architecture ``arch``, built locally.

    Defaults: 2 layers (gemma3: 3, mixing sliding_window=8 and full attention),
    hidden 64, 4 query heads / 2 KV heads of dim 16 (GPT-2: 4 heads, no GQA),
    vocab ``TINY_VOCAB_SIZE`` (260), 1024 positions, fp32, eval mode. Same seed ->
    same weights; the global RNG state is left untouched. ``config_overrides``
    are passed to the config class (e.g. ``num_hidden_layers=3``).

    ``asymmetric=True`` gives a model on which code that uses the wrong norm, bias or head size
    does not pass by accident: the widths of :data:`ASYMMETRIC_SHAPE` (hidden 40, ``head_dim`` 16 != 40 / 4;
    GPT-2: hidden 40, heads of 10), every norm weight (RMSNorm and LayerNorm) and LayerNorm bias
    drawn at random instead of the initial 1 (Gemma-3: 0, its norms scale by 1 + w), and every
    bias the architecture has (Qwen2's q / k / v, GPT-2's; Llama: its optional ``attention_bias`` and
    ``mlp_bias`` turned on) drawn at random instead of 0.
    ``config_overrides`` still apply on top.
    """
    from transformers import AutoModelForCausalLM

    if arch not in SUPPORTED_TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {SUPPORTED_TINY_ARCHS}")
    if asymmetric:
        shape = _ASYMMETRIC_GPT2 if arch == "gpt2" else ASYMMETRIC_SHAPE
        if arch == "llama":  # Llama's optional biases (every projection), which Qwen2's q / k / v-only ones miss
            shape = {**shape, "attention_bias": True, "mlp_bias": True}
        config_overrides = {**shape, **config_overrides}
    config = _tiny_config(arch, config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if asymmetric:
            _break_symmetry(model)
    model.eval()
    return model


@torch.no_grad()
def _break_symmetry(model: torch.nn.Module) -> None:
    """Norm weights and biases of ``model`` drawn at random (from the global RNG, seeded by the caller):
    a norm's weight w [n] gets + U(-0.5, 0.5) per channel (1 -> [0.5, 1.5]; Gemma-3's 0 -> 1 + w in the
    same range), a LayerNorm's bias and every other bias [n] N(0, 0.1^2)."""
    for module in model.modules():
        is_norm = "Norm" in type(module).__name__
        weight = getattr(module, "weight", None)
        if is_norm and isinstance(weight, torch.Tensor) and weight.dim() == 1:
            weight.add_(torch.rand_like(weight) - 0.5)
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and bias.dim() == 1 and bias.is_floating_point():
            bias.add_(torch.randn_like(bias) * 0.1)


def tiny_tokenizer() -> Any:
    """A byte-level tokenizer (one token per UTF-8 byte, ids 0-255, then <s>=256,
    </s>=257, <pad>=258) matching the tiny models' vocabulary. Built locally, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # bytes_to_unicode order: byte b -> alphabet char; build it explicitly so id == byte value.
    byte_chars = _bytes_to_unicode()
    assert sorted(byte_chars.values()) == sorted(alphabet)
    vocab = {byte_chars[b]: b for b in range(256)}
    vocab.update({"<s>": _TINY_BOS, "</s>": _TINY_EOS, "<pad>": _TINY_PAD})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=1024
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (used by ByteLevel)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}
