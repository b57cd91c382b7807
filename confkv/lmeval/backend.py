"""``lm_eval --model confkv``: lm-evaluation-harness requests answered through a compressed KV cache.

lm-evaluation-harness (Gao et al., "A framework for few-shot language model evaluation",
pinned at 0.4.13) asks a backend for three things; this one answers them with a
:class:`~confkv.hf.ConfKVCache` built for each batch:

- ``generate_until``: greedy decoding after a prefill with the streaming protocol (chunks
  evicted as they arrive; ``protocol=query-aware`` defers eviction to the end of the prompt),
  see :mod:`confkv.hf.protocols`; ``until`` strings end a continuation;
- ``loglikelihood``: the continuation's log-probability read through the compressed cache
  (the context prefilled in chunks with eviction, then the continuation in one pass);
- ``loglikelihood_rolling``: not offered (use ``confkv ppl`` for streaming perplexity).

Requests are sorted by length (longest first) and batched ``batch_size`` at a time with left
padding; answers come back in the original order. A batch is prefilled in chunks of the
padded width, so a shorter (padded) row's chunks end at other tokens than they would alone:
with an evicting policy its answer can differ from a batch-1 run (rows of equal length are
answered exactly as alone). Model loading goes through
:func:`confkv.models.load_model` (``model=smollm2``, a local path, a hub id) or, for tests,
``model=tiny-<arch>`` (:func:`confkv.models.tiny_model` with the byte tokenizer).
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from confkv.config import StoreConfig
from confkv.lmeval.settings import BackendSettings, parse_settings

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: model name -> tokenizer of the backends built in this process (confkv's RULER tasks size samples with it)
LOADED_TOKENIZERS: dict[str, Any] = {}


def _usable_device(device: str) -> str:
    """lm_eval's command line passes ``device=cuda:0`` by default: fall back to the CPU where there is no GPU."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        import warnings

        warnings.warn(f"confkv backend: device {device!r} is not available; running on the CPU", stacklevel=3)
        return "cpu"
    return device


def load_named_model(name: str, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a backend ``model=`` name (``tiny-<arch>``: a tiny random test model)."""
    from confkv import models

    if name.startswith("tiny-"):
        model = models.tiny_model(name[len("tiny-"):]).to(device=device, dtype=_DTYPES[dtype])
        return model, models.tiny_tokenizer()
    return models.load_model(name, dtype=_DTYPES[dtype], device=device)


@register_model("confkv")
class ConfKVLM(TemplateLM):
    """An lm-eval model whose KV cache is evicted by a confkv policy (see the module docstring)."""

    def __init__(self, model: Any = None, tokenizer: Any = None, **model_args: Any) -> None:
        super().__init__()
        if model is not None and not isinstance(model, str):  # a loaded model object (Python API)
            if tokenizer is None or isinstance(tokenizer, str):
                raise ValueError("confkv backend: a model object needs its tokenizer object (tokenizer=...)")
            self.settings: BackendSettings = parse_settings(**model_args)
            self.model, self.tokenizer = model, tokenizer
        else:
            self.settings = parse_settings(model=model, **model_args)
            self.settings.device = _usable_device(self.settings.device)
            self.model, self.tokenizer = load_named_model(self.settings.model, self.settings.dtype,
                                                          self.settings.device)
            LOADED_TOKENIZERS[self.settings.model] = self.tokenizer
        self.model.eval()
        self.store = StoreConfig(kv_int8=self.settings.int8, fp_window=self.settings.fp_window,
                                 prefill_chunk=self.settings.chunk)
        from confkv.models import model_max_positions

        self._max_length = self.settings.max_length or model_max_positions(self.model)

    # -- what lm-eval reads ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return int(eos) if eos is not None else 0

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self.settings.batch_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return self.settings.model

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = True
        return list(self.tokenizer(string, add_special_tokens=add_special_tokens, verbose=False)["input_ids"])

    def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def get_model_info(self) -> dict[str, Any]:
        s = self.settings
        return {"confkv_policy": s.policy, "confkv_memory": s.memory, "confkv_max_kv_bytes": s.max_kv_bytes,
                "confkv_int8": s.int8, "confkv_protocol": s.protocol, "confkv_policy_params": s.policy_params}

    # -- the cache's parameters ---------------------------------------------------------------
    def policy_params(self, total_tokens: int) -> dict[str, Any]:
        """The cache's parameters for requests of ``total_tokens`` (prompt + new tokens): the policy's and
        the memory target, the same for every length (the cache holds ``memory`` of the full cache's
        bytes at whatever length it has reached)."""
        return self.settings.cache_params()

    # -- requests ------------------------------------------------------------------------------
    def _batches(self, lengths: list[int]) -> list[list[int]]:
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        size = self.settings.batch_size
        return [order[i:i + size] for i in range(0, len(order), size)]

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from confkv.hf.protocols import generate_compressed

        s = self.settings
        prompts, options = [], []
        for request in requests:
            context, gen_kwargs = request.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.pop("max_gen_toks", s.max_gen_toks))
            if gen_kwargs.get("do_sample"):
                raise ValueError("confkv backend: only greedy decoding (do_sample=False) is supported")
            ids = self.tok_encode(context)
            room = self.max_length - max_new
            if room < 1:
                raise ValueError(f"confkv backend: max_gen_toks={max_new} leaves no room for a prompt in "
                                 f"max_length={self.max_length}")
            prompts.append(ids[-room:])  # keep the end of an over-long prompt, as lm-eval's HF backend does
            options.append((tuple(until), max_new))
        answers: list[str | None] = [None] * len(requests)
        # one batch shares its stop strings and number of new tokens
        groups: dict[tuple, list[int]] = {}
        for i, option in enumerate(options):
            groups.setdefault(option, []).append(i)
        bar = tqdm(total=len(requests), desc="confkv generate_until", disable=disable_tqdm)
        for (until, max_new), members in groups.items():
            for batch in self._batches([len(prompts[i]) for i in members]):
                rows = [members[b] for b in batch]
                total = max(len(prompts[i]) for i in rows) + max_new
                outs = generate_compressed(self.model, self.tokenizer, [prompts[i] for i in rows], policy=s.policy,
                                           params=self.policy_params(total), store=self.store, protocol=s.protocol,
                                           chunk=s.chunk, query_window=s.query_window, max_new_tokens=max_new,
                                           stop=until)
                for i, out in zip(rows, outs):
                    answers[i] = out.text
                bar.update(len(rows))
        bar.close()
        return [a if a is not None else "" for a in answers]

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        from confkv.hf.protocols import score_compressed

        s = self.settings
        pairs = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("confkv backend: an empty continuation cannot be scored")
            keep = self.max_length - len(continuation)
            pairs.append((list(context)[-max(1, keep):], list(continuation)))
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        bar = tqdm(total=len(pairs), desc="confkv loglikelihood", disable=disable_tqdm)
        for batch in self._batches([len(c) + len(x) for c, x in pairs]):
            total = max(len(pairs[i][0]) + len(pairs[i][1]) for i in batch)
            outs = score_compressed(self.model, self.tokenizer, [pairs[i] for i in batch], policy=s.policy,
                                    params=self.policy_params(total), store=self.store, chunk=s.chunk)
            for i, out in zip(batch, outs):
                results[i] = out
            bar.update(len(batch))
        bar.close()
        return [r for r in results if r is not None]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("confkv backend: loglikelihood_rolling (perplexity tasks) is not offered; "
                                  "use `confkv ppl` for streaming perplexity with a compressed cache")


__all__ = ["ConfKVLM", "LOADED_TOKENIZERS", "load_named_model"]
