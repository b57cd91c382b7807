"""llama.cpp's KV cache of one sequence, as bytes: read it, and convert a float16 cache to a block format.

Why: llama.cpp's prefill with a quantized KV cache (``type_k`` / ``type_v`` q8_0 or q4_0) needs
flash attention, whose CPU kernel handles one query row at a time; at 32K tokens of Qwen2.5-1.5B on
two threads that prefill was estimated at about two hours, against 20 minutes for the float16 cache's
prefill (its attention is a matrix product). A decode step's work does not depend on how its cache
was filled, so the bench may fill a quantized row's cache from a float16 prefill instead
(``confkv bench --llamacpp-fill f16``): the float16 keys and values are quantized here into the
row's block format (ggml's reference quantization, ``gguf.quants``: for q4_0, blocks of 32 values,
``d = max / -8`` by the value of largest magnitude, codes ``trunc(x / d + 8.5)`` clipped to 0..15)
and loaded into the quantized context. What the row's timed steps then read is a q4_0 cache of the
same tokens. One difference from llama.cpp's own quantized prefill, stated where the figures are:
there, each layer's later tokens were computed attending to the already quantized cache; here, to
the float16 one (a different rounding of the same computation, not a different amount of work).

The format (``llama_state_seq_get_data`` / ``llama_state_seq_set_data`` of llama.cpp as vendored by
llama-cpp-python 0.3.16, ``llama_kv_cache_unified::state_write``), little-endian::

    u32 n_stream
    per stream: u32 cell_count; if cell_count:
        per cell: i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id
        u32 v_trans, u32 n_layer
        per layer: i32 k_type, u64 k_row_bytes, cell_count x k_row_bytes
        v_trans == 0: per layer: i32 v_type, u64 v_row_bytes, cell_count x v_row_bytes
        v_trans == 1: per layer: i32 v_type, u32 v_element_bytes, u32 n_embd_v,
                      n_embd_v x (cell_count x v_element_bytes)   (channel-major)

This module imports numpy and ``gguf`` only (no torch, no confkv): the bench's llama.cpp child
process loads it beside llama.cpp.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

#: ggml type ids (``ggml.h``; the same numbers as ``gguf.GGMLQuantizationType``)
GGML_F16, GGML_Q4_0, GGML_Q8_0 = 1, 2, 8
#: the block formats a float16 cache converts to: name -> (ggml type id, values per block, bytes per block)
BLOCK_TYPES = {"q8_0": (GGML_Q8_0, 32, 34), "q4_0": (GGML_Q4_0, 32, 18)}


class StateFormatError(ValueError):
    """The bytes are not a llama.cpp sequence state this module can read or convert."""


@dataclass
class StreamState:
    """One stream's cells and per-layer tensors. ``keys[l]`` / ``values[l]`` are ``(ggml type, rows)``,
    rows a ``uint8`` array ``[cell_count, row_bytes]`` (values always cell-major here, whatever
    ``v_trans`` was in the bytes); float16 rows view as ``[cell_count, n_embd]`` with ``.view(np.float16)``."""

    positions: np.ndarray                     # int32 [cell_count]
    seq_ids: list[tuple[int, ...]]            # per cell
    keys: list[tuple[int, np.ndarray]] = field(default_factory=list)
    values: list[tuple[int, np.ndarray]] = field(default_factory=list)


class _Reader:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data, self.at = memoryview(data), 0

    def take(self, count: int) -> memoryview:
        if self.at + count > len(self.data):
            raise StateFormatError(f"the state ends at byte {len(self.data)}: {count} more bytes were expected "
                                   f"at byte {self.at} (not a llama.cpp sequence state, or cut short)")
        chunk = self.data[self.at:self.at + count]
        self.at += count
        return chunk

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))


def read_seq_state(data: bytes | bytearray | memoryview) -> list[StreamState]:
    """Parse the bytes of ``llama_state_seq_get_data`` into one :class:`StreamState` per stream that
    holds cells (empty streams are left out). Raises :class:`StateFormatError` on bytes left over or missing."""
    reader = _Reader(data)
    (n_stream,) = reader.unpack("I")
    streams = []
    for _ in range(n_stream):
        (cells,) = reader.unpack("I")
        if cells == 0:
            continue
        positions = np.empty(cells, dtype=np.int32)
        seq_ids = []
        for i in range(cells):
            positions[i], n_seq = reader.unpack("iI")
            seq_ids.append(reader.unpack(f"{n_seq}i") if n_seq else ())
        v_trans, n_layer = reader.unpack("II")
        stream = StreamState(positions, seq_ids)
        for _ in range(n_layer):
            k_type, row_bytes = reader.unpack("iQ")
            rows = np.frombuffer(reader.take(cells * row_bytes), dtype=np.uint8).reshape(cells, row_bytes)
            stream.keys.append((k_type, rows))
        for _ in range(n_layer):
            if not v_trans:
                v_type, row_bytes = reader.unpack("iQ")
                rows = np.frombuffer(reader.take(cells * row_bytes), dtype=np.uint8).reshape(cells, row_bytes)
            else:
                v_type, element_bytes, n_embd = reader.unpack("iII")
                channel_major = np.frombuffer(reader.take(n_embd * cells * element_bytes), dtype=np.uint8)
                rows = np.ascontiguousarray(channel_major.reshape(n_embd, cells, element_bytes).transpose(1, 0, 2)
                                            ).reshape(cells, n_embd * element_bytes)
            stream.values.append((v_type, rows))
        streams.append(stream)
    if reader.at != len(reader.data):
        raise StateFormatError(f"{len(reader.data) - reader.at} bytes left after the last stream")
    return streams


def write_seq_state(streams: list[StreamState]) -> bytes:
    """The bytes ``llama_state_seq_set_data`` reads for ``streams`` (one stream per entry, values
    written cell-major, ``v_trans = 0``: the layout of a flash-attention context, which every
    quantized llama.cpp cache is)."""
    parts = [struct.pack("<I", len(streams))]
    for stream in streams:
        cells = len(stream.positions)
        parts.append(struct.pack("<I", cells))
        for position, ids in zip(stream.positions.tolist(), stream.seq_ids):
            parts.append(struct.pack(f"<iI{len(ids)}i", position, len(ids), *ids))
        parts.append(struct.pack("<II", 0, len(stream.keys)))
        for tensors in (stream.keys, stream.values):
            for ggml_type, rows in tensors:
                if rows.shape[0] != cells:
                    raise StateFormatError(f"a layer has {rows.shape[0]} rows for {cells} cells")
                parts.append(struct.pack("<iQ", ggml_type, rows.shape[1]))
                parts.append(np.ascontiguousarray(rows, dtype=np.uint8).tobytes())
    return b"".join(parts)


def quantize_rows(rows_f16: np.ndarray, kv_type: str) -> np.ndarray:
    """float16 rows ``[cells, n_embd]`` -> ``uint8 [cells, n_embd / 32 x block bytes]`` in ggml's
    ``kv_type`` block format (``gguf.quants``, ggml's reference quantization)."""
    from gguf import GGMLQuantizationType, quants  # noqa: PLC0415 - only the fill needs it

    if kv_type not in BLOCK_TYPES:
        raise StateFormatError(f"KV type {kv_type!r}: a float16 cache converts to {', '.join(BLOCK_TYPES)}")
    _, block, block_bytes = BLOCK_TYPES[kv_type]
    if rows_f16.ndim != 2 or rows_f16.shape[1] % block:
        raise StateFormatError(f"rows of shape {tuple(rows_f16.shape)}: {kv_type} needs a multiple of {block} "
                               "values a row")
    out = np.empty((rows_f16.shape[0], rows_f16.shape[1] // block * block_bytes), dtype=np.uint8)
    kind = GGMLQuantizationType.Q4_0 if kv_type == "q4_0" else GGMLQuantizationType.Q8_0
    step = 4096  # rows a call: bounded scratch memory at 32K cells
    for start in range(0, rows_f16.shape[0], step):
        out[start:start + step] = quants.quantize(rows_f16[start:start + step].astype(np.float32), kind)
    return out


def convert_f16_state(data: bytes | bytearray | memoryview, kv_type: str) -> bytes:
    """A float16 sequence state (either V layout) -> the same cells with every layer's keys and values
    in ``kv_type`` (q8_0 / q4_0), values cell-major: bytes for a quantized (flash-attention) context.
    Raises :class:`StateFormatError` when a tensor is not float16."""
    if kv_type not in BLOCK_TYPES:
        raise StateFormatError(f"KV type {kv_type!r}: a float16 cache converts to {', '.join(BLOCK_TYPES)}")
    ggml_type = BLOCK_TYPES[kv_type][0]
    streams = read_seq_state(data)
    for stream in streams:
        for tensors, name in ((stream.keys, "keys"), (stream.values, "values")):
            for layer, (source_type, rows) in enumerate(tensors):
                if source_type != GGML_F16:
                    raise StateFormatError(f"layer {layer}'s {name} are ggml type {source_type}, not float16 "
                                           f"({GGML_F16}): fill the row from a float16 cache")
                tensors[layer] = (ggml_type, quantize_rows(rows.view(np.float16), kv_type))
    return write_seq_state(streams)
