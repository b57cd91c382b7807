"""A bounded trace keeps the newest records and exact whole-run peak/mean KV bytes."""

import pytest
import torch

from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from confkv.tiers.planner import MemoryTrace, StepRecord


def _step(total):
    return StepRecord(confidence=torch.zeros(1), budget=torch.zeros(1, dtype=torch.long),
                      kept=torch.zeros(2, 1, dtype=torch.long), kv_bytes=torch.tensor([total, 0]), seen=0)


def test_bounded_trace_summaries_cover_dropped_steps():
    totals = [5, 90, 7, 3, 40, 2, 8]
    bounded, full = MemoryTrace(max_steps=3), MemoryTrace()
    for t in totals:
        bounded.record(_step(t))
        full.record(_step(t))
    assert len(bounded) == 3 and bounded.recorded == len(totals) and bounded.dropped == 4
    assert bounded.total_kv_bytes() == totals[-3:]
    assert bounded.peak_kv_bytes() == full.peak_kv_bytes() == 90
    assert bounded.mean_kv_bytes() == pytest.approx(full.mean_kv_bytes())


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_trace_limit(bad):
    with pytest.raises(ValueError, match="max_steps"):
        MemoryTrace(max_steps=bad)


def test_cache_with_trace_limit_matches_unbounded_run():
    torch.manual_seed(0)
    model = tiny_model("llama")
    ids = torch.randint(5, model.config.vocab_size, (1, 60))
    caches = [ConfKVCache.for_model(model, "confkv", n_high=12, n_low=24, protect=4, trace_limit=limit)
              for limit in (None, 5)]
    with torch.no_grad():
        for cache in caches:
            for t in range(ids.shape[1]):
                model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
    unbounded, bounded = (c.trace for c in caches)
    assert len(bounded) == 5 and bounded.recorded == len(unbounded) == 60
    assert bounded.peak_kv_bytes() == unbounded.peak_kv_bytes()
    assert bounded.mean_kv_bytes() == pytest.approx(unbounded.mean_kv_bytes())
    assert bounded.total_kv_bytes() == unbounded.total_kv_bytes()[-5:]
