"""The native CPU kernels (confkv/native) against their torch references, and the fallback without a compiler."""

from __future__ import annotations

import warnings

import pytest
import torch

from confkv import native
from confkv.attention import KVSegment, attention_read
from confkv.attention.mass_read import mass_read
from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LeanDecoder, _rotate_half
from confkv.models import tiny_model
from confkv.native import loader
from segment_cases import unmasked_segments
from thread_counts import torch_threads

needs_native = pytest.mark.skipif(not native.available(), reason="native kernels unavailable (no C compiler or "
                                  "CONFKV_NATIVE=0; see the warning)")
# buffers the kernels must overwrite (torch.empty, empty_like, new_empty) start as NaN in every test here
pytestmark = pytest.mark.usefixtures("nan_filled_empty")


def _close(got, want, dtype):
    if dtype == torch.float32:  # both are about 2e-6 off a float64 read on these sharp scores
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    else:  # both round a float32 result to bfloat16; summation order may move it by one unit
        torch.testing.assert_close(got, want, equal_nan=True)


def _check_read(query, segments, dtype):
    out, mass = native.mass_read(query, segments, 0.25)
    ref_out, ref_mass = mass_read(query, segments, 0.25)
    assert out.dtype == query.dtype and out.shape == query.shape
    _close(out, ref_out, dtype)
    assert [m.shape for m in mass] == [m.shape for m in ref_mass]
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5, equal_nan=True)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[37], [64, 5], [0, 40, 3], [1, 1, 1]])
@pytest.mark.parametrize("group,num_queries", [(1, 1), (3, 1), (3, 4), (2, 3)])
# 20: the generic C loop (not a multiple of 8); 64 and 128: the inlined vector loops (SmolLM2, Qwen2.5); 16, 48 and
# 256: the general AVX-512 loop, 256 the widest it takes (its register arrays full); 24: the generic C loop with
# AVX-512, the general AVX2 loop without (16, 24: AVX2 sums of 4 and 2 rows at a time, the last pass partial)
@pytest.mark.parametrize("dim", [16, 64, 24, 128, 48, 256, 20])
def test_mass_read_equals_the_torch_mass_read(dtype, lengths, group, num_queries, dim):
    segments = unmasked_segments(lengths, dim=dim, num_queries=num_queries, dtype=dtype)
    spread = min(1.0, (64 / dim) ** 0.5)  # wider heads: the scores as sharp as at 64 channels, not sharper
    query = (spread * torch.randn(2, 3 * group, num_queries, dim, generator=torch.Generator().manual_seed(1))).to(dtype)
    _check_read(query, segments, dtype)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[300, 5], [256, 256, 1], [700], [10, 250, 400]])
@pytest.mark.parametrize("peak", [None, 0, 259, 650])  # one key aligned with the queries takes most of the mass
def test_long_mass_read_equals_the_torch_mass_read(dtype, lengths, peak):
    segments = unmasked_segments(lengths, dim=64, num_queries=2, dtype=dtype)
    query = torch.randn(2, 6, 2, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    if peak is not None and peak < sum(lengths):
        index = peak
        for segment in segments:  # the slot `peak` of the concatenation
            if index < segment.keys.shape[2]:
                segment.keys[:, :, index] = (query[:, ::2, 0] * 4).to(dtype)  # KV head j: its first query head, 2 j
                break
            index -= segment.keys.shape[2]
    _check_read(query, segments, dtype)


@needs_native
def test_mass_read_takes_strided_inputs_and_propagates_nan():
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(1, 4, 6, 64, generator=gen).transpose(1, 2)  # [1, 6, 4, 64] view: strided heads
    big = torch.randn(1, 2, 50, 64, generator=gen)
    segments = [KVSegment(big[:, :, :30], big[:, :, 20:], None),  # slices of one buffer
                KVSegment(torch.randn(1, 2, 7, 64, generator=gen), torch.randn(1, 2, 7, 64, generator=gen), None)]
    _check_read(query, segments, torch.float32)
    segments[1].keys[0, 1, 3, 0] = float("nan")  # one key of KV head 1: that head's rows become NaN, as in torch
    _check_read(query, segments, torch.float32)
    out, mass = native.mass_read(query, segments, 0.25)
    assert out[0, 3:].isnan().all() and not out[0, :3].isnan().any() and mass[0][0, 1].isnan().all()
    long = [KVSegment(torch.randn(1, 2, 600, 64, generator=gen), torch.randn(1, 2, 600, 64, generator=gen), None)]
    long[0].keys[0, 0, 590, 5] = float("nan")  # near the end of a long segment: all of head 0's rows are NaN
    out, mass = native.mass_read(query, long, 0.25)
    assert out[0, :3].isnan().all() and not out[0, 3:].isnan().any() and mass[0][0, 0].isnan().all()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_portable_c_loops_equal_the_torch_mass_read(dtype, tmp_path, monkeypatch):
    """A build without AVX-512 runs the generic C loops for every head dim."""
    path = loader.build(tmp_path, loader.default_flags() + ["-mno-avx512f"])
    monkeypatch.setitem(loader._state, "lib", loader.load(path))
    for lengths, dim in (([33, 0, 8], 64), ([5], 16)):
        segments = unmasked_segments(lengths, dim=dim, dtype=dtype)
        query = torch.randn(2, 9, 1, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
        _check_read(query, segments, dtype)


def _hf_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm.forward, written out."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@needs_native
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 3, 64), (5, 8), (1, 2, 2048), (3, 37)])
def test_rms_norm_equals_llama_rms_norm_bit_for_bit(x_dtype, w_dtype, shape):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=gen) * 3).to(x_dtype)
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(w_dtype)
    if not native._sum_lanes(loader.library()):
        pytest.skip("torch's float sum order is not reproduced on this torch build (bfloat16 runs the torch code)")
    got, want = native.rms_norm(x, weight, 1e-5), _hf_rms_norm(x, weight, 1e-5)
    assert got.dtype == want.dtype and torch.equal(got, want)  # the mean summed in torch's order
    strided = torch.cat([x, x], -1)[..., : shape[-1]]  # rows two widths apart
    assert torch.equal(native.rms_norm(strided, weight, 1e-5), _hf_rms_norm(strided, weight, 1e-5))


@needs_native
def test_torch_order_sum_reproduces_torch_sum_on_long_and_odd_rows():
    lib = loader.library()
    lanes = native._sum_lanes(lib)
    if not lanes:
        pytest.skip("torch's float sum order is not reproduced on this torch build")
    gen = torch.Generator().manual_seed(8)
    for n in (1, 7, 100, 513, 3000, 5000, 16384):  # tails, leftover vectors and the level cascade
        row = torch.randn(n, generator=gen).pow(2)
        assert lib.confkv_torch_order_sum(row.data_ptr(), n, lanes) == row.sum().item()
    # Rows far past the kernels' widths (MAX_EXACT_WIDTH): the cascade's second and third levels flushing, and
    # levels of 2^5 steps (past 2^26 floats); 2^24 + 3 gives 2^19 blocks of four vectors at 8 lanes exactly (the
    # level size worked out from a power of two: 2^4 steps, not 2^5). torch splits a row that long over its threads
    # (each summing a chunk in this order), so the order is torch's at one thread.
    with torch_threads(1):
        for n in (100_003, 4_000_037, 2**24 + 3, 2**26 + 2**20 + 3):
            row = torch.rand(n, generator=gen)
            assert lib.confkv_torch_order_sum(row.data_ptr(), n, lanes) == row.sum().item(), n


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,length", [(1, 1), (2, 5)])
def test_rotary_equals_the_torch_lines_exactly(dtype, batch, length):
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(batch, length, 6, 64, generator=gen).to(dtype)  # [B, q, H, D]
    key = torch.randn(batch, length, 2, 64, generator=gen).to(dtype)
    cos, sin = (torch.randn(batch, length, 64, generator=gen).to(dtype) for _ in range(2))
    got_q, got_k = native.rotary(query, key, cos, sin)
    for got, x in ((got_q, query), (got_k, key)):
        x = x.transpose(1, 2)
        want = x * cos[:, None] + _rotate_half(x) * sin[:, None]
        assert torch.equal(got.transpose(1, 2), want)  # every product and the sum rounded as torch does


@needs_native
def test_unsupported_dtypes_return_none_for_the_torch_path():
    half = torch.randn(1, 1, 2, 8).half()
    assert native.rotary(half, half, half[:, :, 0], half[:, :, 0]) is None
    assert native.rms_norm(half, torch.ones(8).half(), 1e-5) is None
    assert native.mass_read(half.transpose(1, 2), [KVSegment(half, half, None)], 1.0) is None


@needs_native
def test_tensors_off_the_cpu_return_none_for_the_torch_path():
    """The C code reads data pointers: a tensor in another device's memory (here ``meta``, standing
    in for CUDA) must never reach it, whichever argument it is."""
    cpu = torch.randn(1, 1, 2, 8)
    meta = torch.empty(1, 1, 2, 8, device="meta")
    assert native.rotary(meta, cpu, cpu[:, :, 0], cpu[:, :, 0]) is None
    assert native.rotary(cpu, cpu, cpu[:, :, 0], meta[:, :, 0]) is None
    assert native.rms_norm(meta, torch.ones(8), 1e-5) is None
    assert native.rms_norm(cpu, torch.ones(8, device="meta"), 1e-5) is None
    assert native.mass_read(meta.transpose(1, 2), [KVSegment(cpu, cpu, None)], 1.0) is None
    assert native.mass_read(cpu.transpose(1, 2), [KVSegment(cpu, meta, None)], 1.0) is None
    assert native.rms_norm(cpu, torch.ones(8), 1e-5) is not None  # the CPU case does run

@needs_native
def test_auto_dispatch_takes_the_native_read_for_the_mass(monkeypatch):
    import confkv.attention.read_plan as attention  # the read and the names it calls

    calls, original = [], native.mass_read
    monkeypatch.setattr(native, "mass_read", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setattr(attention, "mass_read", lambda *a: pytest.fail("the torch mass read ran"))
    segments = unmasked_segments([12, 4])
    query = torch.randn(2, 6, 1, 16, generator=torch.Generator().manual_seed(6))
    out, mass = attention_read(query, segments, 0.3, need_mass=True, backend="auto")
    assert len(calls) == 1
    ref_out, ref_mass = mass_read(query, segments, 0.3)
    _close(out, ref_out, torch.float32)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_decoder_with_native_kernels_equals_it_without(dtype, monkeypatch):
    """H2O (mass-ranked eviction) through the lean decoder: the same logits and kept tokens with the
    native kernels as with the torch code."""
    model = tiny_model("llama", seed=3).to(dtype)
    ids = torch.randint(1, 250, (1, 50), generator=torch.Generator().manual_seed(0))
    runs = []
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setitem(loader._state, "lib", None)
        cache = ConfKVCache.for_model(model, "h2o", budget=20, protect=4)
        lean = LeanDecoder(model)
        prefill(model, cache, ids[:, :30], chunk=8)
        logits = torch.stack([lean(ids[:, t:t + 1], cache) for t in range(30, 50)])
        runs.append((logits, [layer.store.old.positions.clone() for layer in cache.layers]))
    _close(runs[0][0], runs[1][0], dtype)
    for got, want in zip(runs[0][1], runs[1][1]):
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_without_a_compiler_one_warning_names_the_fix_and_the_torch_code_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("CONFKV_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CONFKV_NATIVE", raising=False)
    with pytest.warns(RuntimeWarning, match="no C compiler found.*no-such-cc.*install one.*CONFKV_NATIVE=0"):
        assert not native.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        assert not native.available()
        segments = unmasked_segments([20, 3])
        query = torch.randn(2, 6, 1, 16, generator=torch.Generator().manual_seed(7))
        out, mass = attention_read(query, segments, 0.3, need_mass=True, backend="auto")
        ref_out, ref_mass = mass_read(query, segments, 0.3)
        assert torch.equal(out, ref_out) and all(torch.equal(a, b) for a, b in zip(mass, ref_mass))
        assert native.rms_norm(query, torch.ones(16), 1e-5) is None
        assert native.rotary(query, query, query[:, 0], query[:, 0]) is None
        model = tiny_model("llama")
        caches = [ConfKVCache.for_model(model, "full") for _ in range(2)]
        token = torch.tensor([[5, 7, 9]])
        expected = model(input_ids=token, cache=caches[0], logits_to_keep=1).logits[:, -1]
        torch.testing.assert_close(LeanDecoder(model)(token, caches[1]), expected, rtol=1e-5, atol=1e-5)
    assert not (tmp_path / "cache").exists()


def test_a_failing_compiler_is_named_in_the_warning(tmp_path, monkeypatch):
    fake = tmp_path / "broken-cc"
    fake.write_text("#!/bin/sh\necho 'broken-cc: fatal error' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(loader, "_state", {})
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("CONFKV_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CONFKV_NATIVE", raising=False)
    # a plain build: under `make sanitize-native SANITIZER=thread` the stub, run with libtsan preloaded, says nothing
    monkeypatch.delenv("CONFKV_NATIVE_SANITIZE", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with pytest.warns(RuntimeWarning, match="(?s)broken-cc failed to build kernels.c.*fatal error.*CONFKV_NATIVE=0"):
        assert not native.available()
    assert list((tmp_path / "cache").iterdir()) == []  # no half-written library left behind


def test_confkv_native_0_disables_without_a_warning(monkeypatch):
    monkeypatch.setattr(loader, "_state", {})
    monkeypatch.setenv("CONFKV_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native.available()
        assert native.mass_read(torch.randn(1, 3, 1, 8), unmasked_segments([4], kv_heads=3, dim=8), 1.0) is None


@needs_native
def test_the_library_is_cached_by_source_flags_and_compiler(tmp_path):
    first = loader.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert loader.build(tmp_path) == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    other = loader.build(tmp_path, loader.FLAGS + ["-O2"])
    assert other != first and sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])


@needs_native
def test_a_changed_part_of_the_source_builds_a_new_library(tmp_path, monkeypatch):
    """kernels.c includes its parts from c/: the build's hash covers them, so an edited part is rebuilt."""
    import shutil

    parts = tmp_path / "c"
    shutil.copytree(loader.PARTS, parts)
    source = tmp_path / "kernels.c"
    shutil.copy(loader.SOURCE, source)
    monkeypatch.setattr(loader, "SOURCE", source)
    monkeypatch.setattr(loader, "PARTS", parts)
    first = loader.build(tmp_path / "cache")
    assert loader.build(tmp_path / "cache") == first  # cached
    layer = parts / "layer.c"
    layer.write_text(layer.read_text() + "\n/* edited */\n")
    second = loader.build(tmp_path / "cache")
    assert second != first and second.exists()


def test_a_sanitizer_is_asked_by_name_and_an_unknown_one_is_refused(monkeypatch):
    """``$CONFKV_NATIVE_SANITIZE`` (``make sanitize-native``) adds AddressSanitizer's, ThreadSanitizer's or UBSan's
    flags to the build (so its library has its own hash) when its runtime is preloaded, and says how to preload it
    when not; a name the loader does not know stops the build with the names it knows."""
    monkeypatch.delenv("CONFKV_NATIVE_SANITIZE", raising=False)
    assert loader.default_flags() == loader.FLAGS
    monkeypatch.setenv("CONFKV_NATIVE_SANITIZE", "address")
    monkeypatch.setenv("LD_PRELOAD", "")
    with pytest.raises(loader.NativeBuildError, match=r"LD_PRELOAD=\$\(cc -print-file-name=libasan.so\)"):
        loader.default_flags()  # without its runtime first the library would not load
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libasan.so")
    assert loader.default_flags() == loader.FLAGS + ["-fsanitize=address", "-fno-omit-frame-pointer"]
    monkeypatch.setenv("CONFKV_NATIVE_SANITIZE", "thread")  # libasan preloaded is not libtsan
    with pytest.raises(loader.NativeBuildError, match=r"LD_PRELOAD=\$\(cc -print-file-name=libtsan.so\)"):
        loader.default_flags()
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtsan.so.2")
    assert loader.default_flags() == loader.FLAGS + ["-fsanitize=thread", "-DCONFKV_POOL_STATIC"]
    monkeypatch.setenv("CONFKV_NATIVE_SANITIZE", "undefined")  # libubsan, not "libusan"
    with pytest.raises(loader.NativeBuildError, match=r"LD_PRELOAD=\$\(cc -print-file-name=libubsan.so\)"):
        loader.default_flags()
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/gcc/x86_64-linux-gnu/12/libubsan.so")
    flags = loader.default_flags()
    assert "-fsanitize=undefined,float-cast-overflow" in flags  # the cast of NaN or a value past the type: not in
    assert "-fno-sanitize-recover=undefined,float-cast-overflow" in flags  # GCC's -fsanitize=undefined alone
    monkeypatch.setenv("CONFKV_NATIVE_SANITIZE", "memory")
    with pytest.raises(loader.NativeBuildError,
                       match=r"'memory' is not a sanitizer.*\['address', 'thread', 'undefined'\]"):
        loader.default_flags()
