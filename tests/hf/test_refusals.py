import pytest
import torch
from transformers import BertConfig, BertLMHeadModel

from confkv import PromptTooLongError, UnsupportedModelError
from confkv.hf import ConfKVCache, generate
from confkv.models import tiny_model


def test_crop_is_refused_with_a_clear_error():
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, "confkv", n_high=64, n_low=128)
    with pytest.raises(NotImplementedError, match="cannot be cropped.*assisted decoding"):
        cache.crop(-1)


def test_assisted_decoding_is_refused():
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, "confkv", n_high=64, n_low=128)
    ids = torch.randint(0, 250, (1, 8))
    with pytest.raises(Exception, match="(?i)cannot be cropped|assisted decoding"):
        model.generate(ids, cache=cache, assistant_model=tiny_model("llama", seed=1), max_new_tokens=6,
                       do_sample=False)


def test_unsupported_architecture_names_the_supported_ones():
    model = BertLMHeadModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, is_decoder=True))
    with pytest.raises(UnsupportedModelError, match="model_type='bert'.*llama.*gpt2"):
        ConfKVCache.for_model(model, "confkv")


def test_prompt_longer_than_positions():
    model = tiny_model("llama", max_position_embeddings=32)
    cache = ConfKVCache.for_model(model, "full")
    with pytest.raises(PromptTooLongError, match="32 positions"):
        generate(model, torch.randint(0, 250, (1, 30)), cache, max_new_tokens=5)


def test_model_without_confkv_attention_is_detected():
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, "confkv", n_high=64, n_low=128)
    model.set_attn_implementation("sdpa")
    with pytest.raises((UnsupportedModelError, RuntimeError), match="attn_implementation='confkv'"):
        with torch.no_grad():
            model(torch.randint(0, 250, (1, 4)), cache=cache, use_cache=True)
