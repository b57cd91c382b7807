"""attention_read / reads_pages (confkv/attention/__init__.py): which backend runs, with which arguments.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md). The dispatch rules are the
ones documented in ``attention_read``'s docstring: "auto" picks triton when the query is on CUDA and
triton imports, else fused where eligible, else (mass needed) the mass read, in its native version when
available, else the block-wise torch read; every backend but triton reads a PagedSegment via ``to_dense``.
The backends are replaced by spies that record which one ran and what it was given; the CUDA query is a
CPU tensor whose ``is_cuda`` says True (no GPU here), with ``triton_available`` forced True.
"""

import math

import pytest
import torch

import confkv.attention.read_plan as attention  # the read and the names it calls
from confkv import native
from confkv.attention import KVSegment, attention_read, reads_pages, triton_read


class _CudaLike(torch.Tensor):
    """A CPU tensor that says it is on CUDA (only ``is_cuda`` is read by the dispatch)."""

    @property
    def is_cuda(self):
        return True


def _data(seed=0, heads=2, kv_heads=1, queries=1, length=5, dim=4):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, queries, dim, generator=gen)
    keys = torch.randn(1, kv_heads, length, dim, generator=gen)
    values = torch.randn(1, kv_heads, length, dim, generator=gen)
    return query, keys, values


def _reference(query, keys, values, scaling, softcap=None):
    """Plain float64 softmax attention, GQA by repeating the KV heads."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return (torch.softmax(scores, dim=-1) @ v).float()


@pytest.fixture
def spies(monkeypatch):
    """Replace every backend (and densify) by a recorder; each returns a distinct sentinel."""
    calls = []

    def recorder(name, result):
        def spy(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result
        return spy

    real_densify = attention.densify

    def densify(segments):
        calls.append(("densify", (segments,), {}))
        return real_densify(segments)

    monkeypatch.setattr(attention, "densify", densify)
    monkeypatch.setattr(attention, "blockwise_attention", recorder("torch", ("torch-out", None)))
    monkeypatch.setattr(attention, "mass_read", recorder("mass", ("mass-out", None)))
    monkeypatch.setattr(attention.fused_cpu, "fused_attention", recorder("fused", "fused-out"))
    monkeypatch.setattr(triton_read, "triton_attention", recorder("triton", ("triton-out", None)))
    return calls


def _ran(calls):
    return [name for name, _, _ in calls if name != "densify"]


def _densified(calls):
    return any(name == "densify" for name, _, _ in calls)


def test_an_unknown_backend_is_refused_with_the_list_of_backends():
    query, keys, values = _data()
    with pytest.raises(ValueError) as refused:
        attention_read(query, [KVSegment(keys, values, None)], 0.5, backend="nope")
    assert str(refused.value) == "backend must be one of ('auto', 'torch', 'fused', 'triton'), got 'nope'"


def test_reads_pages_only_for_the_triton_read(monkeypatch):
    cpu = torch.zeros(1, 1, 1, 4)
    cuda = cpu.as_subclass(_CudaLike)
    monkeypatch.setattr(triton_read, "triton_available", lambda: True)
    assert reads_pages(cuda, "auto") is True  # auto on CUDA with triton -> the paged Triton read
    assert reads_pages(cuda, "triton") is True
    assert reads_pages(cpu, "triton") is True
    assert reads_pages(cuda, "torch") is False
    assert reads_pages(cuda, "fused") is False
    assert reads_pages(cpu, "auto") is False
    monkeypatch.setattr(triton_read, "triton_available", lambda: False)
    assert reads_pages(cuda, "auto") is False


def test_auto_on_cuda_with_triton_runs_triton_on_the_pages_as_given(spies, monkeypatch):
    monkeypatch.setattr(triton_read, "triton_available", lambda: True)
    query, keys, values = _data()
    query = query.as_subclass(_CudaLike)
    segments = [KVSegment(keys, values, None)]
    result = attention_read(query, segments, 0.25, softcap=3.0, need_mass=True, backend="auto")
    assert result == ("triton-out", None)
    assert _ran(spies) == ["triton"]
    assert not _densified(spies)  # the Triton read takes PagedSegments itself
    _, args, kwargs = spies[0]
    assert args[0] is query and list(args[1]) == segments and args[2] == 0.25
    assert kwargs == {"softcap": 3.0, "need_mass": True}


def test_explicit_triton_backend_runs_triton_with_the_query_and_segments(spies):
    query, keys, values = _data()
    segments = [KVSegment(keys, values, None)]
    result = attention_read(query, segments, 0.5, need_mass=False, backend="triton")
    assert result == ("triton-out", None)
    assert _ran(spies) == ["triton"]
    assert not _densified(spies)
    _, args, kwargs = spies[0]
    assert args[0] is query and list(args[1]) == segments and args[2] == 0.5
    assert kwargs == {"softcap": None, "need_mass": False}


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cpu_reads_densify_and_run_torch(spies, backend):
    query, keys, values = _data()
    segments = [KVSegment(keys, values, torch.ones(1, 1, 1, 5, dtype=torch.bool))]  # a mask: no fused, no mass read
    assert attention_read(query, segments, 0.5, block_size=2, backend=backend) == ("torch-out", None)
    assert _ran(spies) == ["torch"]
    assert _densified(spies)
    _, args, kwargs = spies[-1]  # the torch read gets the query, the segments, the scaling and the block size
    assert args[0] is query and args[2:] == (0.5, 2) and kwargs == {"softcap": None, "need_mass": True}


def test_auto_with_mass_uses_the_native_read_when_it_answers(spies, monkeypatch):
    """native.mass_read returns None when the library is unavailable; when it answers, its result is used."""
    native_calls = []

    def native_read(query, segments, scaling):
        native_calls.append((query, segments, scaling))
        return "native-out", ["native-mass"]

    monkeypatch.setattr(native, "mass_read", native_read)
    monkeypatch.setattr(native, "available", lambda: True)  # also under CONFKV_NATIVE=0 (make mutate)
    query, keys, values = _data()
    segments = [KVSegment(keys, values, None)]
    assert attention_read(query, segments, 0.375, need_mass=True) == ("native-out", ["native-mass"])
    assert _ran(spies) == []
    ((q, segs, scaling),) = native_calls
    assert q is query and list(segs) == segments and scaling == 0.375


def test_auto_with_mass_falls_back_to_the_torch_mass_read_without_native(spies, monkeypatch):
    monkeypatch.setattr(native, "mass_read", lambda *args: None)
    query, keys, values = _data()
    segments = [KVSegment(keys, values, None)]
    assert attention_read(query, segments, 0.375, need_mass=True) == ("mass-out", None)
    assert _ran(spies) == ["mass"]
    _, args, _ = spies[-1]
    assert args[0] is query and list(args[1]) == segments and args[2] == 0.375


def test_fused_read_uses_the_given_scaling():
    """No spies: the fused kernel's output equals plain softmax attention at scaling 0.9 (not D ** -0.5)."""
    query, keys, values = _data(seed=1, heads=4, kv_heads=2, queries=2, length=6, dim=8)
    out, mass = attention_read(query, [KVSegment(keys, values, None)], 0.9, need_mass=False, backend="fused")
    assert mass is None
    torch.testing.assert_close(out, _reference(query, keys, values, 0.9), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, _reference(query, keys, values, 1 / math.sqrt(8)), atol=1e-3)


def test_a_softcap_is_not_read_by_the_fused_kernel(spies):
    """Fused ignores the soft cap, so a soft-capped read goes to the block-wise read ("auto") or is refused ("fused")."""
    query, keys, values = _data()
    segments = [KVSegment(keys, values, None)]
    assert attention_read(query, segments, 0.5, softcap=2.0, need_mass=False) == ("torch-out", None)
    assert _ran(spies) == ["torch"]
    _, args, kwargs = spies[-1]
    assert kwargs == {"softcap": 2.0, "need_mass": False}
    with pytest.raises(ValueError):
        attention_read(query, segments, 0.5, softcap=2.0, need_mass=False, backend="fused")


def test_a_softcapped_auto_read_matches_the_reference():
    query, keys, values = _data(seed=2, length=7)
    out, mass = attention_read(query, [KVSegment(keys, values, None)], 2.0, softcap=1.5, need_mass=False)
    assert mass is None
    torch.testing.assert_close(out, _reference(query, keys, values, 2.0, softcap=1.5), atol=1e-5, rtol=1e-5)


def test_fused_backend_refusal_message_in_full():
    query, keys, values = _data()
    with pytest.raises(ValueError) as refused:
        attention_read(query, [KVSegment(keys, values, None)], 0.5, need_mass=True, backend="fused")
    assert str(refused.value) == (
        "backend 'fused' needs a CPU query, full-precision segments of its dtype, no mask, "
        "no softcap and need_mass=False; use backend='auto' to fall back to the block-wise read")

