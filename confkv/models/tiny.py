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


def tiny_model(arch: str, *, seed: int = 0, **config_overrides: Any) -> Any:
    """A tiny randomly initialised causal LM of architecture ``arch``, built locally.

    Defaults: 2 layers (gemma3: 3, mixing sliding_window=8 and full attention),
    hidden 64, 4 query heads / 2 KV heads of dim 16 (GPT-2: 4 heads, no GQA),
    vocab ``TINY_VOCAB_SIZE`` (260), 1024 positions, fp32, eval mode. Same seed ->
    same weights; the global RNG state is left untouched. ``config_overrides``
    are passed to the config class (e.g. ``num_hidden_layers=3``).
    """
    from transformers import AutoModelForCausalLM

    if arch not in SUPPORTED_TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {SUPPORTED_TINY_ARCHS}")
    config = _tiny_config(arch, config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model


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
