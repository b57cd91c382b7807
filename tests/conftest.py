import os

import pytest
import torch
from thread_counts import torch_threads

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton reads TRITON_INTERPRET when it is first imported, and some test modules import it
# indirectly at collection (transformers' BERT in test_hf_refusals.py) before
# test_triton_read.py sets it: set it here, first, or the interpreted kernel tests fail
# when the whole suite runs ("Cannot call @triton.jit'd outside of the scope of a kernel").
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test leaves torch's thread count as it found it (the CLI's ``--threads``, a test that set it and
    failed): a count left behind would run every later test of the process at it."""
    with torch_threads(torch.get_num_threads()):
        yield


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (integration tests only)."""
    from confkv.models import load_model

    return load_model("smollm2")


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests with one torch thread (restored afterwards)."""
    with torch_threads(1):
        yield


@pytest.fixture(params=["native", "torch"])
def native_and_torch_code(request):
    """Runs a test twice: with the native kernels (when built) and with the torch code (kernels off)."""
    from confkv.native import loader

    if request.param == "torch":
        with loader.disabled():
            yield
    else:
        yield


def _poisoned(make):
    """``make`` (torch.empty, torch.empty_like, Tensor.new_empty) whose result is filled with NaN (floats), the
    dtype's lowest value (integers) or True (bool): memory a caller must overwrite, never zeros left over."""
    def poisoned(*args, **kwargs):
        out = make(*args, **kwargs)
        with torch.no_grad():
            if out.is_floating_point() or out.is_complex():
                out.fill_(float("nan"))
            elif out.dtype == torch.bool:
                out.fill_(True)
            else:
                out.fill_(torch.iinfo(out.dtype).min)
        return out
    return poisoned


@pytest.fixture
def nan_filled_empty(monkeypatch):
    """Within the test, buffers made with torch.empty / empty_like / Tensor.new_empty start poisoned (NaN, the
    lowest integer, True), so code that reads a slot it should have written first fails loudly instead of
    passing on whatever the allocator left there."""
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned(torch.Tensor.new_empty))
