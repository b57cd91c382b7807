"""Random left-padded prompts for the property tests (tests/hf/test_property_cache.py,
tests/tiers/test_memory_target.py)."""

import torch


def left_padded_prompt(gen: torch.Generator, batch: int, prompt: int, pads: list[int], pad_id: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [batch, prompt] random in [0, 250) and mask [batch, prompt] (1 = real token); row ``b`` starts with
    ``pads[b]`` padding tokens ``pad_id`` (mask 0)."""
    ids = torch.randint(0, 250, (batch, prompt), generator=gen)
    mask = torch.ones(batch, prompt, dtype=torch.long)
    for b, pad in enumerate(pads):
        mask[b, :pad] = 0
        ids[b, :pad] = pad_id
    return ids, mask
