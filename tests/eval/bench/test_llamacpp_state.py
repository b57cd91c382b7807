"""llama.cpp's sequence state as bytes (``confkv.eval.bench.llamacpp_state``): read in both V layouts,
written back byte for byte, and a float16 cache converted to q4_0 / q8_0 blocks as ggml's reference
quantization writes them. The states are built here with ``struct``, from the layout in llama.cpp's
``llama_kv_cache_unified::state_write``, not with the module's own writer."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from confkv.eval.bench.llamacpp_state import (GGML_F16, GGML_Q4_0, GGML_Q8_0, StateFormatError, convert_f16_state,
                                              read_seq_state, write_seq_state)


def f16_state(keys, values, positions, v_trans, seq_ids=None):
    """Bytes of one stream: ``keys`` / ``values`` lists (per layer) of float16 [cells, n_embd]."""
    cells = len(positions)
    seq_ids = seq_ids or [(0,)] * cells
    parts = [struct.pack("<II", 1, cells)]
    for pos, ids in zip(positions, seq_ids):
        parts.append(struct.pack(f"<iI{len(ids)}i", pos, len(ids), *ids))
    parts.append(struct.pack("<II", v_trans, len(keys)))
    for k in keys:
        parts += [struct.pack("<iQ", GGML_F16, 2 * k.shape[1]), k.astype(np.float16).tobytes()]
    for v in values:
        if v_trans:
            parts += [struct.pack("<iII", GGML_F16, 2, v.shape[1]), v.astype(np.float16).T.copy().tobytes()]
        else:
            parts += [struct.pack("<iQ", GGML_F16, 2 * v.shape[1]), v.astype(np.float16).tobytes()]
    return b"".join(parts)


def _layers(rng, count, cells, n_embd):
    return [rng.standard_normal((cells, n_embd)).astype(np.float16) for _ in range(count)]


@pytest.mark.parametrize("v_trans", [0, 1])
def test_read_gives_cells_keys_and_cell_major_values(v_trans):
    rng = np.random.default_rng(0)
    keys, values = _layers(rng, 3, 5, 64), _layers(rng, 3, 5, 64)
    positions = [7, 8, 9, 10, 12]
    seq_ids = [(0,), (0,), (0, 2), (0,), ()]
    (stream,) = read_seq_state(f16_state(keys, values, positions, v_trans, seq_ids))
    assert stream.positions.tolist() == positions and stream.seq_ids == seq_ids
    for (k_type, k_rows), (v_type, v_rows), k, v in zip(stream.keys, stream.values, keys, values):
        assert k_type == v_type == GGML_F16
        assert np.array_equal(k_rows.view(np.float16), k) and np.array_equal(v_rows.view(np.float16), v)


def test_write_gives_back_the_bytes_read_and_empty_streams_are_skipped():
    rng = np.random.default_rng(1)
    data = f16_state(_layers(rng, 2, 4, 32), _layers(rng, 2, 4, 32), [0, 1, 2, 3], v_trans=0,
                     seq_ids=[(0,), (0, 2), (), (3, 1)])
    assert write_seq_state(read_seq_state(data)) == data
    two_streams = struct.pack("<II", 2, 0) + data[4:]  # an empty stream, then the one above
    (stream,) = read_seq_state(two_streams)
    assert stream.positions.tolist() == [0, 1, 2, 3]


def ggml_q4_0(row):
    """ggml's quantize_row_q4_0_ref for one float32 row, written out here: blocks of 32, d = (the value of
    largest magnitude) / -8, codes min(15, trunc(x / d + 8.5)), the first 16 in the low nibbles."""
    out = b""
    for block in row.reshape(-1, 32).astype(np.float32):
        peak = block[np.argmax(np.abs(block))]
        d = np.float32(peak / -8)
        inv = np.float32(1 / d) if d else np.float32(0)
        codes = np.minimum(15, np.trunc(block * inv + np.float32(8.5))).astype(np.uint8)
        out += np.float16(d).tobytes() + (codes[:16] | (codes[16:] << 4)).astype(np.uint8).tobytes()
    return out


@pytest.mark.parametrize("v_trans", [0, 1])
def test_f16_to_q4_0_blocks_as_ggml_writes_them(v_trans):
    rng = np.random.default_rng(2)
    keys, values = _layers(rng, 2, 6, 64), _layers(rng, 2, 6, 64)
    keys[0][1] = 0  # blocks of zeros: d = 0 / -8 = -0.0 (as in ggml's C), every code 8
    converted = convert_f16_state(f16_state(keys, values, list(range(6)), v_trans), "q4_0")
    (stream,) = read_seq_state(converted)
    assert struct.unpack_from("<II", converted, 4 + 4 + 6 * 12) == (0, 2)  # written cell-major (v_trans 0)
    for tensors, sources in ((stream.keys, keys), (stream.values, values)):
        for (ggml_type, rows), source in zip(tensors, sources):
            assert ggml_type == GGML_Q4_0 and rows.shape == (6, 2 * 18)
            for row, expected in zip(rows, source):
                assert row.tobytes() == ggml_q4_0(expected.astype(np.float32))
    assert stream.keys[0][1][1].tobytes() == (np.float16(-0.0).tobytes() + bytes([0x88]) * 16) * 2


def test_f16_to_q8_0_stays_within_half_a_step():
    """q8_0: d = max |x| / 127, stored as float16; so |x - d' q| <= d / 2 + 127 |d - d'| <= d (1/2 + 127 / 2048)."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(3)
    keys, values = _layers(rng, 1, 4, 64), _layers(rng, 1, 4, 64)
    (stream,) = read_seq_state(convert_f16_state(f16_state(keys, values, [0, 1, 2, 3], 1), "q8_0"))
    for (ggml_type, rows), source in ((stream.keys[0], keys[0]), (stream.values[0], values[0])):
        assert ggml_type == GGML_Q8_0 and rows.shape == (4, 2 * 34)
        back = quants.dequantize(rows, GGMLQuantizationType.Q8_0)
        steps = np.abs(source.astype(np.float32)).reshape(4, 2, 32).max(axis=2, keepdims=True) / 127
        error = np.abs(back - source.astype(np.float32)).reshape(4, 2, 32)
        assert np.all(error <= steps * (0.5 + 127 / 2048) + 1e-7)
        assert error.max() > steps.min() * 0.25  # really quantized


def test_bad_states_are_named():
    rng = np.random.default_rng(4)
    data = f16_state(_layers(rng, 1, 2, 32), _layers(rng, 1, 2, 32), [0, 1], v_trans=0)
    with pytest.raises(StateFormatError, match="more bytes were expected"):
        read_seq_state(data[:-1])
    with pytest.raises(StateFormatError, match="1 bytes left after the last stream"):
        read_seq_state(data + b"\0")
    quantized = convert_f16_state(data, "q4_0")
    with pytest.raises(StateFormatError, match="keys are ggml type 2, not float16"):
        convert_f16_state(quantized, "q8_0")
    with pytest.raises(StateFormatError, match="KV type 'q5_1': a float16 cache converts to q8_0, q4_0"):
        convert_f16_state(data, "q5_1")
    odd = f16_state([np.zeros((2, 48), np.float16)], [np.zeros((2, 48), np.float16)], [0, 1], v_trans=0)
    with pytest.raises(StateFormatError, match="needs a multiple of 32 values a row"):
        convert_f16_state(odd, "q4_0")
