import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (integration tests only)."""
    from confkv.models import load_model

    return load_model("smollm2")
