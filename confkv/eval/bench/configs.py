"""The configurations ``confkv bench`` compares: transformers' caches, confkv's policies and the memory preset's rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BenchConfig:
    """One cache configuration of the benchmark."""

    name: str
    kind: str  # "dynamic", "quantized" or "confkv"
    policy: str = "full"
    params: dict[str, Any] = field(default_factory=dict)
    store: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    lean: bool = False  # decode steps through confkv.hf.lean.LeanDecoder instead of model(...)
    native: bool = True  # False: decode steps with confkv.native's kernels off (the torch code; A/B rows)


def _preset_slacks(slack: int | float, preset_slacks: tuple[int | float, ...]) -> list[int | float]:
    """The slacks of the preset's ``+slack`` rows: ``slack`` (when not 0), then each of ``preset_slacks`` once."""
    return list(dict.fromkeys(s for s in (slack, *preset_slacks) if s))


def preset_rows(memory: tuple[float, ...], formats: tuple[str, ...] = (), slack: int | float = 0,
                preset_slacks: tuple[int | float, ...] = ()) -> list[str]:
    """The names of the memory preset's rows: ``tiered@<percent>`` per target, ``tiered@<percent>-lean`` (the
    same through the lean decoder), ``tiered@<percent>+slack<s>-lean`` (that with eviction slack ``s``, for
    ``slack`` when not 0 and each of ``preset_slacks``: a count of tokens or a share of the tokens kept by rank),
    ``tiered@<percent>+int8-lean`` (an INT8 hot tier), ``tiered@<percent>+open8-lean`` (the ladder's open page in
    INT8), ``tiered-int8@<percent>-lean`` (the preset ``tiered-int8``), then ``tiered[<format>]@<percent>`` per
    target and page format of ``formats``."""
    return ([f"tiered@{fraction * 100:g}" for fraction in memory]
            + [f"tiered@{fraction * 100:g}-lean" for fraction in memory]
            + [f"tiered@{fraction * 100:g}+slack{s}-lean" for s in _preset_slacks(slack, preset_slacks)
               for fraction in memory]
            + [f"tiered@{fraction * 100:g}+int8-lean" for fraction in memory]
            + [f"tiered@{fraction * 100:g}+open8-lean" for fraction in memory]
            + [f"tiered-int8@{fraction * 100:g}-lean" for fraction in memory]
            + [f"tiered[{name}]@{fraction * 100:g}" for name in formats for fraction in memory])


def default_configs(budget: int, slack: int | float, memory: tuple[float, ...] = (0.25,),
                    formats: tuple[str, ...] = (), preset_slacks: tuple[int | float, ...] = ()) -> list[BenchConfig]:
    """The comparison grid: transformers caches, confkv full, fixed-budget baselines, CONF-KV, and the memory
    preset (``tiered@<percent>``: the cache holding ``memory`` of the full cache's bytes at every step;
    ``tiered[<format>]@<percent>``: the same with the page format ``format`` on every rung)."""
    half = budget // 2
    gate = {"n_high": budget - half // 2, "n_low": budget + half // 2, "tau": 0.5}
    int8 = {"kv_int8": True, "fp_window": min(128, budget // 4)}
    configs = [
        BenchConfig("dynamic", "dynamic", note="transformers DynamicCache, sdpa"),
        BenchConfig("quantized", "quantized", note="transformers QuantizedCache (quanto int4), sdpa"),
        BenchConfig("full", "confkv", "full", note="confkv store, no eviction (our overhead)"),
        BenchConfig("full-blockwise", "confkv", "full", store={"read_backend": "torch"},
                    note="the same with the block-wise read instead of the fused CPU kernel (before/after)"),
        BenchConfig(f"window", "confkv", "window", {"budget": budget}),
        BenchConfig(f"streaming", "confkv", "streaming", {"budget": budget}),
        BenchConfig(f"h2o", "confkv", "h2o", {"budget": budget}),
        BenchConfig("confkv", "confkv", "confkv", dict(gate), note=f"n_high/n_low around {budget}"),
        BenchConfig("confkv-int8", "confkv", "confkv", dict(gate), dict(int8)),
    ]
    if slack:
        configs += [
            BenchConfig(f"window+slack{slack}", "confkv", "window", {"budget": budget}, {"evict_slack": slack}),
            BenchConfig(f"confkv+slack{slack}", "confkv", "confkv", dict(gate), {"evict_slack": slack}),
            BenchConfig(f"confkv-int8+slack{slack}", "confkv", "confkv", dict(gate),
                        {**int8, "evict_slack": slack}),
            BenchConfig(f"confkv+slack{slack}-lean", "confkv", "confkv", dict(gate), {"evict_slack": slack},
                        note="the same, decode steps through the lean decoder (Llama family)", lean=True),
            BenchConfig(f"confkv+slack{slack}-lean-torch", "confkv", "confkv", dict(gate), {"evict_slack": slack},
                        note="the lean row with confkv.native's kernels off (read, RMSNorm, rotary in torch)",
                        lean=True, native=False),
        ]
    configs += [BenchConfig(f"tiered@{fraction * 100:g}", "confkv", "tiered", {"memory": fraction},
                            note=f"the memory preset at {fraction:g} of the full cache's bytes") for fraction in memory]
    configs += [BenchConfig(f"tiered@{fraction * 100:g}-lean", "confkv", "tiered", {"memory": fraction}, lean=True,
                            note=f"the memory preset at {fraction:g}, decode steps through the lean decoder")
                for fraction in memory]
    # the hot tier evicted down to its budget - slack, so ranking and compaction run once per slack + 1 steps; the
    # bytes stay under the target (the hot tier only shrinks below its share)
    configs += [BenchConfig(f"tiered@{fraction * 100:g}+slack{s}-lean", "confkv", "tiered", {"memory": fraction},
                            {"evict_slack": s}, lean=True,
                            note=f"the lean preset row with evict_slack={s} (opt-in, not the preset's default)")
                for s in _preset_slacks(slack, preset_slacks) for fraction in memory]
    configs += [BenchConfig(f"tiered@{fraction * 100:g}+int8-lean", "confkv", "tiered", {"memory": fraction,
                            "hot_int8_window": 8}, lean=True, note=f"the lean preset row with an INT8 hot tier "
                            "(hot_int8_window=8: INT8 past 8 recent tokens once over the target)")
                for fraction in memory]
    configs += [BenchConfig(f"tiered@{fraction * 100:g}+open8-lean", "confkv", "tiered", {"memory": fraction,
                            "open_bits": 8}, lean=True, note="the lean preset row with the ladder's open page in INT8 "
                            "(open_bits=8)") for fraction in memory]
    configs += [BenchConfig(f"tiered-int8@{fraction * 100:g}-lean", "confkv", "tiered-int8", {"memory": fraction},
                            lean=True, note="the preset tiered-int8 (the quality setting: INT8 hot tier and open page) "
                            "through the lean decoder") for fraction in memory]
    configs += [BenchConfig(f"tiered-int8@{fraction * 100:g}+ladder-slack{s:g}-lean", "confkv", "tiered-int8",
                            {"memory": fraction, "ladder_slack": s}, lean=True,
                            note=f"tiered-int8 with ladder_slack={s:g}: the ladder's step-downs several pages at once")
                for s in (0.01, 0.03) for fraction in memory]
    configs += [BenchConfig(f"tiered[{name}]@{fraction * 100:g}", "confkv", "tiered", {"memory": fraction, "format": name},
                            note=f"the memory preset at {fraction:g}, page format {name}")
                for name in formats for fraction in memory]
    # the tiered store at the same hot budget: 2-bit cold pages, 4 / 16 pages read when confident / not
    tiered = {"budget": budget, "bits": 2, "page_size": 32, "group_size": 32, "k_high": 4, "k_low": 16}
    configs += [BenchConfig("confkv-r", "confkv", "confkv-r", dict(tiered), note="hot budget + 2-bit cold tier")]
    if slack:
        configs += [
            BenchConfig(f"confkv-r+slack{slack}", "confkv", "confkv-r", dict(tiered), {"evict_slack": slack}),
            BenchConfig(f"confkv-r-offload+slack{slack}", "confkv", "confkv-r", {**tiered, "offload": True},
                        {"evict_slack": slack}, note="cold pages in a memory-mapped file"),
        ]
    return configs


def kivi_rows(specs: tuple[str, ...]) -> list[BenchConfig]:
    """KIVI rows (every older token kept in low-bit pages and read, the native page read's heaviest load) named
    ``kivi-<spec>`` for each spec ``BITS[/VALUE_BITS][:FORMAT]`` (``4``, ``4/2:hadamard+outliers+clip``): keys at
    ``BITS``, values at ``VALUE_BITS`` (default ``BITS``), page format ``FORMAT`` (default ``kivi``), pages and
    groups of 64 tokens, the policy's 128-token full-precision window. Page formats compared at equal load.

    Raises:
        ValueError: a spec that is not of that form (the policy checks the widths and the format when it is built).
    """
    rows = []
    for spec in specs:
        widths, _, format = spec.partition(":")
        bits, slash, value_bits = widths.partition("/")
        if not bits.isdigit() or (slash and not value_bits.isdigit()) or (":" in spec and not format):
            raise ValueError(f"--kivi: {spec!r} is not BITS[/VALUE_BITS][:FORMAT], e.g. 4 or 4/2:hadamard+outliers")
        params: dict[str, Any] = {"bits": int(bits), "group_size": 64, "page_size": 64, "format": format or "kivi"}
        if value_bits:
            params["value_bits"] = int(value_bits)
        rows.append(BenchConfig(f"kivi-{spec}", "confkv", "kivi", params,
                                note=f"KIVI, keys {bits} bits, values {value_bits or bits}, format {params['format']}"))
    return rows
