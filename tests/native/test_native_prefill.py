"""The native read of a prefill chunk (confkv/native/c/prefill.c, confkv/native/prefill.py) and its place in the
read plan.

The reference is softmax attention in float64 over the same bfloat16 numbers. The C read sums bfloat16 products
in float32 and rounds its output to bfloat16 once, so each output is within half a bfloat16 step of the float64
value, plus float32 rounding (``_assert_rounded_once``); a read that dropped a scale, a mask row, a key or a
row would be off by far more. Masses are float32 throughout: ``atol=1e-6``. Both arithmetic paths run: the
AVX512-BF16 kernels and the plain C ones (``native_prefill.portable``).
"""

from __future__ import annotations

import math

import pytest
import torch

from confkv.attention import KVSegment, attention_read, read_plan
from confkv.attention.blockwise import blockwise_attention
from confkv.native import prefill as native_prefill
from confkv.native.loader import available, disabled, library
from thread_counts import torch_threads

pytestmark = [pytest.mark.skipif(not available(), reason="no C compiler: the native kernels are unavailable"),
              pytest.mark.usefixtures("nan_filled_empty")]  # buffers to be overwritten start as NaN

MASS_TOL = dict(atol=1e-6, rtol=0.0)


@pytest.fixture(params=[False, True], ids=["vector", "portable"])
def arithmetic(request, monkeypatch):
    """Run the test on the AVX512-BF16 kernels and on the plain C ones."""
    if not request.param and not native_prefill.vectorised(library()):
        pytest.skip("this CPU has no AVX512-BF16: only the plain C kernels exist here")
    monkeypatch.setattr(native_prefill, "portable", request.param)
    return request.param


def _reference(query, segments, scaling):
    """(out [B, Hq, Q, D] float64, masses [B, Hkv, L_s] float64, sum_l p_l |v_l| [B, Hq, Q, D]) of softmax
    attention over the segments in float64; a row that sees nothing has output 0 and adds no mass."""
    batch, q_heads, num_queries, dim = query.shape
    kv_heads = segments[0].keys.shape[1]
    group = q_heads // kv_heads
    keys = torch.cat([s.keys for s in segments], dim=2).double().repeat_interleave(group, dim=1)
    values = torch.cat([s.values for s in segments], dim=2).double().repeat_interleave(group, dim=1)
    seen = []
    for s in segments:
        shape = (batch, kv_heads, num_queries, s.length)
        visible = torch.ones(shape, dtype=torch.bool) if s.visible is None else s.visible.to(torch.bool)
        while visible.dim() < 4:
            visible = visible.unsqueeze(0)
        seen.append(visible.expand(shape))
    seen = torch.cat(seen, dim=-1).repeat_interleave(group, dim=1)
    scores = (query.double() @ keys.transpose(-1, -2) * scaling).masked_fill(~seen, float("-inf"))
    any_seen = seen.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~any_seen, 0.0), dim=-1) * any_seen
    mass = probs.view(batch, kv_heads, group, num_queries, -1).sum(3).mean(2)
    return probs @ values, list(torch.split(mass, [s.length for s in segments], dim=-1)), probs @ values.abs()


def _assert_rounded_once(out: torch.Tensor, exact: torch.Tensor, spread: torch.Tensor) -> None:
    """Each bfloat16 output within half a bfloat16 step of the float64 value, plus what float32 sums may add:
    2^-16 of ``spread`` = sum_l p_l |v_l| (a sum that cancels keeps the absolute error of its terms)."""
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    magnitude = torch.maximum(exact.abs(), out.double().abs()).clamp_min(1e-30)
    step = torch.exp2(torch.floor(torch.log2(magnitude)) - 7)  # bfloat16 keeps 8 significant bits
    error = (out.double() - exact).abs()
    bound = step / 2 + spread * 2.0 ** -16 + 1e-30
    worst = (error / bound).max().item()
    assert worst <= 1.0, f"an output is {worst:.2f}x past half a bfloat16 step from the float64 value"


def _data(seed, batch, kv_heads, group, queries, lengths, dim):
    gen = torch.Generator().manual_seed(seed)
    query = (torch.randn(batch, kv_heads * group, queries, dim, generator=gen) * 2).bfloat16()
    segments = []
    for length in lengths:
        keys = (torch.randn(batch, kv_heads, length, dim, generator=gen) + 0.3).bfloat16()
        values = torch.randn(batch, kv_heads, length, dim, generator=gen).bfloat16()
        segments.append(KVSegment(keys, values, None))
    return query, segments


def _causal(queries, length):
    """[1, 1, Q, L] bool: query q (the last Q of L slots) sees slots up to its own."""
    return (torch.arange(length)[None, :] <= torch.arange(length - queries, length)[:, None])[None, None]


# (batch, kv heads, group, queries, segment lengths, head size): ragged rows (G * Q not a multiple of the 32 rows
# of a unit), ragged keys (not a multiple of 64), several segments and an empty one, every tail of the value
# kernel's 64-channel tiles (D = 16, 32, 48, 80, 112) and the shapes of SmolLM2 (64) and Qwen2.5 (128)
SHAPES = [(1, 2, 3, 40, (30, 70), 64), (2, 1, 4, 17, (0, 129), 16), (1, 2, 2, 33, (64,), 32),
          (1, 1, 6, 12, (5, 60, 7), 48), (1, 1, 5, 13, (100,), 80), (2, 2, 6, 11, (65,), 112),
          (1, 2, 6, 64, (300, 64), 128)]


@pytest.mark.parametrize("batch, kv_heads, group, queries, lengths, dim", SHAPES)
@pytest.mark.parametrize("need_mass", [True, False])
def test_the_prefill_read_is_softmax_attention_rounded_once(arithmetic, batch, kv_heads, group, queries, lengths,
                                                           dim, need_mass):
    query, segments = _data(1, batch, kv_heads, group, queries, lengths, dim)
    last = segments[-1]  # the chunk's own keys: causal, as a store hands them over
    segments[-1] = KVSegment(last.keys, last.values, _causal(queries, last.length) if last.length >= queries else None)
    scaling = dim ** -0.5
    out, masses = native_prefill.prefill_read(query, segments, scaling, need_mass)
    exact, exact_masses, spread = _reference(query, segments, scaling)
    _assert_rounded_once(out, exact, spread)
    if not need_mass:
        assert masses is None
        return
    for mass, want in zip(masses, exact_masses):
        assert mass.dtype == torch.float32 and mass.shape == want.shape
        torch.testing.assert_close(mass.double(), want, **MASS_TOL)


@pytest.mark.parametrize("lengths", [(4000, 100), (9000,), (17000,)],
                         ids=["16 rows a unit", "8 rows a unit", "never fewer than 8"])
def test_long_keys_take_fewer_rows_a_unit(arithmetic, lengths):
    """Past 4,096 keys a unit takes 16 query rows (its kept scores within 512 KiB), past 8,192 eight, and never
    fewer (the vector kernels take rows eight at a time): 42 rows (not a multiple of either) over 4,100, 9,000 and
    17,000 keys, a causal corner on the last segment."""
    query, segments = _data(13, 1, 2, 2, 21, lengths, 16)
    last = segments[-1]
    segments[-1] = KVSegment(last.keys, last.values, _causal(21, last.length))
    out, masses = native_prefill.prefill_read(query, segments, 0.25, True)
    exact, exact_masses, spread = _reference(query, segments, 0.25)
    _assert_rounded_once(out, exact, spread)
    for mass, want in zip(masses, exact_masses):
        torch.testing.assert_close(mass.double(), want, **MASS_TOL)


@pytest.mark.parametrize("batch, kv_heads, group, queries, lengths, dim", SHAPES[:1] + SHAPES[3:5] + SHAPES[-1:])
def test_float32_segments_beside_bfloat16_ones_are_read(arithmetic, batch, kv_heads, group, queries, lengths, dim):
    """Cold pages reach this read dequantized to float32, beside the hot keys in bfloat16: every older segment in
    float32 (keys and values), the chunk's own in bfloat16."""
    query, segments = _data(11, batch, kv_heads, group, queries, lengths, dim)
    gen = torch.Generator().manual_seed(12)
    older = [KVSegment(s.keys.float() + 1e-3 * torch.randn(s.keys.shape, generator=gen),  # not bfloat16 numbers
                       s.values.float() + 1e-3 * torch.randn(s.values.shape, generator=gen), None)
             for s in segments[:-1]]
    segments = [*older, segments[-1]]
    out, masses = native_prefill.prefill_read(query, segments, dim ** -0.5, True)
    exact, exact_masses, spread = _reference(query, segments, dim ** -0.5)
    _assert_rounded_once(out, exact, spread)
    for mass, want in zip(masses, exact_masses):
        torch.testing.assert_close(mass.double(), want, **MASS_TOL)


@pytest.mark.parametrize("lengths, dim", [((2000,), 16), ((70, 130), 64)], ids=["2000 keys, D 16", "two, D 64"])
def test_float32_segments_read_last_over_many_blocks(arithmetic, lengths, dim):
    """Every segment in float32, the last one over several 64-key blocks: a score block written one key or one row
    past its own lands on keys already scored (the last segment has no later one to write over it again), and a
    long one reaches past the unit's kept scores into its bookkeeping."""
    query, segments = _data(14, 1, 2, 4, 16, lengths, dim)
    gen = torch.Generator().manual_seed(15)
    segments = [KVSegment(s.keys.float() + 1e-3 * torch.randn(s.keys.shape, generator=gen),
                          s.values.float() + 1e-3 * torch.randn(s.values.shape, generator=gen), None)
                for s in segments]
    out, masses = native_prefill.prefill_read(query, segments, dim ** -0.5, True)
    exact, exact_masses, spread = _reference(query, segments, dim ** -0.5)
    _assert_rounded_once(out, exact, spread)
    for mass, want in zip(masses, exact_masses):
        torch.testing.assert_close(mass.double(), want, **MASS_TOL)


def test_each_row_is_softmaxed_at_its_own_maximum_wherever_it_falls(arithmetic):
    """Two query rows whose best key, at the last slot of a 64-key block (63 and 127), scores 128 and 64: a
    maximum that missed a block's last key leaves ``exp`` an argument ~120 past its range; a softmax shifted up
    by its maximum instead of down (``s + max``) takes ``exp`` of 59-69 for the row's ordinary keys and past its
    range for the best one. With ordinary scores the softmax does not care which maximum it subtracts, so only
    large ones show it (at 128 alone the shifted-up softmax is still right by accident: every term falls out of
    range the same way)."""
    query, segments = _data(16, 1, 1, 4, 16, (130,), 64)
    keys = segments[0].keys.clone()
    keys[0, 0, 63] = 4.0
    keys[0, 0, 127] = -4.0
    query[0, 1, 5] = 4.0  # row 1 * 16 + 5: q . k_63 = 1024, times 1/8
    query[0, 2, 9] = 0.0
    query[0, 2, 9, :32] = -4.0  # q . k_127 = 512, times 1/8
    segments = [KVSegment(keys, segments[0].values, None)]
    out, masses = native_prefill.prefill_read(query, segments, 0.125, True)
    exact, exact_masses, spread = _reference(query, segments, 0.125)
    assert exact_masses[0][0, 0, 63] > 0.24 and exact_masses[0][0, 0, 127] > 0.24  # a quarter of the 4 heads each
    _assert_rounded_once(out, exact, spread)
    torch.testing.assert_close(masses[0].double(), exact_masses[0], **MASS_TOL)


def test_sixty_four_segments_are_read_and_the_kernel_itself_refuses_more_or_an_odd_head_size(arithmetic):
    """The C read's own check (``eligible`` refuses these first): up to 64 segments, an even head size; past
    them a ValueError that names both limits, before anything is read."""
    gen = torch.Generator().manual_seed(17)
    lengths = tuple(int(n) for n in torch.randint(0, 9, (64,), generator=gen))
    query, segments = _data(17, 1, 1, 4, 16, lengths, 16)
    out, masses = native_prefill.prefill_read(query, segments, 0.25, True)
    exact, exact_masses, spread = _reference(query, segments, 0.25)
    _assert_rounded_once(out, exact, spread)
    for mass, want in zip(masses, exact_masses):
        torch.testing.assert_close(mass.double(), want, **MASS_TOL)
    with pytest.raises(ValueError, match="at most 64 segments"):
        native_prefill.prefill_read(query, segments + segments[:1], 0.25, False)
    query, segments = _data(17, 1, 1, 4, 16, (20,), 15)
    with pytest.raises(ValueError, match="even head size"):
        native_prefill.prefill_read(query, segments, 0.25, False)


def test_a_read_too_big_for_memory_is_refused_not_attempted():
    """A segment that says it holds 2^44 slots (one key, expanded: no memory behind it): the packed keys would take
    512 TiB, so the C read returns before packing and the wrapper raises MemoryError."""
    query, (segment,) = _data(18, 1, 1, 4, 16, (1,), 16)
    huge = KVSegment(segment.keys.expand(1, 1, 2 ** 44, 16), segment.values.expand(1, 1, 2 ** 44, 16), None)
    with pytest.raises(MemoryError, match="out of memory"):
        native_prefill.prefill_read(query, [huge], 0.25, False)


@pytest.mark.parametrize("kind", ["per sequence", "per KV head", "whole rows", "none seen"])
def test_masks_of_every_broadcast_shape_are_read(arithmetic, kind):
    """Masks as a store makes them ([B, 1 or Hkv, Q or 1, L]) and one broadcast along the slots ([..., 1]: a
    slot stride of 0); rows that see nothing have a zero output and add no mass."""
    batch, kv_heads, group, queries, length, dim = 2, 2, 3, 24, 90, 32
    query, (segment,) = _data(2, batch, kv_heads, group, queries, (length,), dim)
    gen = torch.Generator().manual_seed(3)
    if kind == "per sequence":  # left padding: sequence 1 sees none of its first 37 slots
        visible = torch.ones(batch, 1, 1, length, dtype=torch.bool)
        visible[1, ..., :37] = False
        visible = visible & _causal(queries, length)
    elif kind == "per KV head":
        visible = torch.rand(1, kv_heads, queries, length, generator=gen) < 0.6
    elif kind == "whole rows":  # [B, 1, Q, 1]: a row sees every slot or none
        visible = torch.rand(batch, 1, queries, 1, generator=gen) < 0.5
        visible[0, 0, 0, 0] = True
    else:
        visible = torch.zeros(batch, 1, queries, length, dtype=torch.bool)
    segments = [KVSegment(segment.keys, segment.values, visible)]
    out, masses = native_prefill.prefill_read(query, segments, 0.2, True)
    exact, exact_masses, spread = _reference(query, segments, 0.2)
    _assert_rounded_once(out, exact, spread)
    torch.testing.assert_close(masses[0].double(), exact_masses[0], **MASS_TOL)
    if kind == "none seen":
        assert not out.float().any() and not masses[0].any()


def test_a_nan_query_row_makes_its_own_outputs_nan_and_no_others(arithmetic):
    query, segments = _data(4, 1, 1, 2, 40, (70,), 32)
    query[0, 1, 5, 3] = float("nan")
    out, _ = native_prefill.prefill_read(query, segments, 0.2, False)
    assert out[0, 1, 5].isnan().all()
    finite = torch.ones(out.shape[:3], dtype=torch.bool)
    finite[0, 1, 5] = False
    assert not out[finite].isnan().any()


def test_threads_change_no_bit():
    query, segments = _data(5, 2, 2, 6, 40, (200, 50), 64)
    segments[-1] = KVSegment(segments[-1].keys, segments[-1].values, _causal(40, 50))
    with torch_threads(1):
        one = native_prefill.prefill_read(query, segments, 0.125, True)
        torch.set_num_threads(2)
        two = native_prefill.prefill_read(query, segments, 0.125, True)
    assert torch.equal(one[0], two[0])
    assert all(torch.equal(a, b) for a, b in zip(one[1], two[1]))


def test_the_vector_and_plain_kernels_agree_to_float32_sums(monkeypatch):
    if not native_prefill.vectorised(library()):
        pytest.skip("this CPU has no AVX512-BF16")
    query, segments = _data(6, 1, 2, 6, 48, (333,), 128)
    vector = native_prefill.prefill_read(query, segments, 128 ** -0.5, True)
    monkeypatch.setattr(native_prefill, "portable", True)
    plain = native_prefill.prefill_read(query, segments, 128 ** -0.5, True)
    torch.testing.assert_close(vector[0].float(), plain[0].float(), atol=1e-5, rtol=2 ** -7)
    torch.testing.assert_close(vector[1][0], plain[1][0], **MASS_TOL)


def _plan(query, segments, softcap=None, need_mass=False):
    return read_plan.plan(query, segments, softcap, need_mass, "auto").path


def test_the_plan_sends_a_prefill_chunk_here_and_nothing_else():
    if not native_prefill.vectorised(library()):
        pytest.skip("this CPU has no AVX512-BF16: the plan does not take the plain C kernels")
    query, segments = _data(7, 1, 2, 4, 16, (40, 16), 64)  # 4 * 16 = 64 rows: the least it takes
    segments[-1] = KVSegment(segments[-1].keys, segments[-1].values, _causal(16, 16))
    assert _plan(query, segments) == "native_prefill"
    assert _plan(query, segments, need_mass=True) == "native_prefill"
    assert _plan(query[:, :, :15], [KVSegment(s.keys, s.values, None) for s in segments]) != "native_prefill"
    assert _plan(query, segments, softcap=30.0) == "torch"
    assert _plan(query.float(), segments) != "native_prefill"
    fp32 = [KVSegment(s.keys.float(), s.values.float(), s.visible) for s in segments]  # pages dequantized
    assert _plan(query, fp32) == "native_prefill"
    int8 = [KVSegment(s.keys.to(torch.int8), s.values, s.visible, key_token_scale=torch.ones(s.keys.shape[:3]),
                      key_channel_scale=torch.ones(s.keys.shape[:2] + s.keys.shape[3:])) for s in segments]
    assert _plan(query, int8) != "native_prefill"
    odd, odd_segments = _data(8, 1, 1, 64, 1, (40,), 40)  # a head size that is not a multiple of 16
    assert _plan(odd, odd_segments, need_mass=True) != "native_prefill"
    with disabled():
        assert _plan(query, segments) == "torch"


def test_attention_read_returns_the_prefill_read_with_its_mass():
    if not native_prefill.vectorised(library()):
        pytest.skip("this CPU has no AVX512-BF16")
    query, segments = _data(9, 1, 2, 3, 30, (100, 30), 64)
    segments[-1] = KVSegment(segments[-1].keys, segments[-1].values, _causal(30, 30))
    out, masses = attention_read(query, segments, 0.125, need_mass=True)
    reference, reference_masses = blockwise_attention(query, segments, 0.125, need_mass=True)
    torch.testing.assert_close(out.float(), reference.float(), atol=1e-5, rtol=2 ** -7)
    for mass, want in zip(masses, reference_masses):
        torch.testing.assert_close(mass, want, **MASS_TOL)
    assert math.isclose(sum(m.sum().item() for m in masses), 30 * 2, rel_tol=1e-5)  # Q queries x Hkv heads


def test_each_arithmetic_runs_where_asked(monkeypatch):
    """The one difference between the two arithmetics: ``vdpbf16ps`` reads a bfloat16 subnormal as zero, plain C
    multiplies it. A key whose only nonzero channel is the smallest subnormal (2^-133), a query of 2^100 there
    and a scaling of 2^40 give that key a score of 128 in plain C and 0 in the vector kernel: its probability
    is 1 against 1/2, so each path shows which one ran."""
    if not native_prefill.vectorised(library()):
        pytest.skip("this CPU has no AVX512-BF16")
    query = torch.zeros(1, 1, 64, 16, dtype=torch.bfloat16)
    query[..., 0] = 2.0 ** 100
    keys = torch.zeros(1, 1, 2, 16, dtype=torch.bfloat16)
    keys[0, 0, 0, 0] = 2.0 ** -133
    assert keys[0, 0, 0, 0].item() > 0  # representable: a bfloat16 subnormal
    values = torch.zeros(1, 1, 2, 16, dtype=torch.bfloat16)
    values[0, 0, 0] = 1.0
    segments = [KVSegment(keys, values, None)]
    vector, _ = native_prefill.prefill_read(query, segments, 2.0 ** 40, False)
    monkeypatch.setattr(native_prefill, "portable", True)
    plain, _ = native_prefill.prefill_read(query, segments, 2.0 ** 40, False)
    assert (vector[..., 0] == 0.5).all() and (plain[..., 0] == 1.0).all()


def test_a_bfloat16_model_prefills_through_this_read_with_the_same_tokens(monkeypatch):
    """A tiny asymmetric Llama in bfloat16 (GQA 3, head size 16), two prompts of 150 tokens, one left-padded:
    the prompt's read takes this path in every layer (full KV, and H2O, which needs the mass), and the greedy
    tokens and logits are those of the torch read; full KV's are those of transformers' own cache."""
    if not native_prefill.vectorised(library()):
        pytest.skip("this CPU has no AVX512-BF16")
    from transformers import DynamicCache

    from confkv.hf import ConfKVCache
    from confkv.models.tiny import tiny_model

    model = tiny_model("llama", asymmetric=True, num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                       head_dim=16).to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    calls = []
    real = native_prefill.prefill_read
    monkeypatch.setattr(native_prefill, "prefill_read", lambda *a, **k: calls.append(a[3]) or real(*a, **k))

    def generate(cache):
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        return out.sequences[:, 150:], torch.stack(out.logits).float()

    layers = model.config.num_hidden_layers
    for policy, settings in (("full", {}), ("h2o", {"budget": 64})):
        calls.clear()
        tokens, logits = generate(ConfKVCache.for_model(model, policy, **settings))
        assert calls == [policy == "h2o"] * layers  # the prompt, every layer; the mass only where it is needed
        with disabled():
            torch_tokens, torch_logits = generate(ConfKVCache.for_model(model, policy, **settings))
        assert torch.equal(tokens, torch_tokens)
        torch.testing.assert_close(logits, torch_logits, atol=2e-2, rtol=0.0)
        if policy == "full":
            own_tokens, own_logits = generate(DynamicCache())
            assert torch.equal(tokens, own_tokens)
            torch.testing.assert_close(logits, own_logits, atol=2e-2, rtol=0.0)


def test_the_memory_preset_prefills_its_pages_through_this_read(monkeypatch):
    """The preset at memory=0.25 prefilling 320 tokens in chunks of 64 (tiny asymmetric Llama, bfloat16): once
    the ladder holds pages, a chunk's read gets them dequantized (float32) beside the hot keys (bfloat16); the
    logits are those of the read without this path (the block-wise torch read), to bfloat16 rounding."""
    if not native_prefill.vectorised(library()):
        pytest.skip("this CPU has no AVX512-BF16")
    from confkv.hf import ConfKVCache, prefill
    from confkv.models.tiny import tiny_model

    model = tiny_model("llama", asymmetric=True, num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                       head_dim=16).to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 320), generator=torch.Generator().manual_seed(0))
    kinds = []
    real = native_prefill.prefill_read
    monkeypatch.setattr(native_prefill, "prefill_read",
                        lambda q, segments, *a: kinds.append({s.keys.dtype for s in segments}) or real(q, segments, *a))

    def run():
        cache = ConfKVCache.for_model(model, memory=0.25)
        with torch.no_grad():
            return prefill(model, cache, ids, chunk=64).float()

    logits = run()
    layers = model.config.num_hidden_layers
    assert len(kinds) == 5 * layers and {torch.bfloat16, torch.float32} in kinds  # pages read in a chunk
    monkeypatch.setattr(native_prefill, "eligible", lambda *args: False)
    kinds.clear()
    torch_logits = run()
    assert not kinds
    torch.testing.assert_close(logits, torch_logits, atol=2e-2, rtol=0.0)
