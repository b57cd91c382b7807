"""One Markdown (and optionally HTML) page from a results folder.

Collected recursively under the folder:

- sweep rows (``*.jsonl`` with ``ppl`` rows from :mod:`confkv.eval.quality.sweep`): a table per file,
  perplexity at matched KV memory plots (one panel per memory size; mean and peak labels), and the sawtooth trace of the
  gated runs whose trace was saved (``trace_file``);
- ``confkv ppl --out`` JSON files (``summary`` + ``trace``): a table and a trace plot each;
- ``niah.json`` (:mod:`confkv.eval.niah`): accuracy per policy and protocol, the heatmap;
- ``probe.json`` (:mod:`confkv.eval.quality.probe`): correlation table and the scatter.

Plots the report draws go to ``<out dir>/report_assets/``; images are linked relatively.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any


def _rel(path: Path, base: Path) -> str:
    return os.path.relpath(path, base).replace(os.sep, "/")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "nan" if v != v else (f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}")
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return lines + [""]


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _sweep_section(path: Path, base: Path, assets: Path) -> list[str]:
    from confkv.eval.report.plots import plot_ppl_at_memory, plot_trace, trace_from_dict
    from confkv.eval.quality.sweep import gap_table, load_rows, memory_size

    rows = [r for r in load_rows(path) if "ppl" in r and "policy" in r]
    if not rows:
        return []
    slug = _rel(path, base).replace("/", "_").removesuffix(".jsonl")
    first = rows[0]

    def size_text(size: tuple[str, float] | None) -> str:
        if size is None:
            return "-"
        return f"{size[1]:.1%}" if size[0] == "memory" else f"{size[1]:g}-token window"

    def size_order(r: dict) -> tuple:
        size = memory_size(r)
        return (size is not None, size[0] if size else "", -(size[1] if size else 0))

    how = ("each cache held the row's `memory` (a fraction of the full cache's bytes) at the end of every step; "
           "`max share` = the largest bytes / target over the steps" if any(r.get("memory") for r in rows) else
           f"memory matched offline on **{first.get('match')}** KV bytes against full-precision sliding windows "
           "(before memory targets); `match error` = measured / target - 1")
    lines = [f"### Sweep `{_rel(path, base)}`", "",
             f"Model `{first.get('model')}`, corpus `{first.get('corpus')}`, {first.get('tokens')} tokens; {how}.", ""]
    full = {bool(r.get("kv_int8")): r["ppl"] for r in rows if r["policy"] == "full"}
    table = []
    for r in sorted(rows, key=lambda r: (size_order(r), bool(r.get("kv_int8")), r["ppl"])):
        share = r.get("max_target_share") if r.get("memory") else r.get("match_error")
        table.append([r["policy"], "INT8" if r.get("kv_int8") else "FP", size_text(memory_size(r)),
                      json.dumps(r.get("params", {}), sort_keys=True), r["ppl"],
                      r["peak_kv_bytes"] / 1e6, r["mean_kv_bytes"] / 1e6,
                      share if share is not None else float("nan"),
                      r["ppl"] - full.get(False, float("nan"))])
    lines += _table(["policy", "KV", "memory", "params", "PPL", "peak MB", "mean MB",
                     "max share" if any(r.get("memory") for r in rows) else "match error", "PPL - full"], table)
    gaps = gap_table(rows)
    if gaps:
        lines += ["Gap closure at the same memory: `drop vs window` = PPL(window) - PPL; the share of the "
                  "window-to-full and StreamingLLM-to-full perplexity gaps closed (100% = full KV, 0% = no better "
                  "than the baseline, negative = worse).", ""]
        gaps.sort(key=lambda g: (g["memory_kind"], -g["memory"], -g["streaming_gap_closed"]))
        lines += _table(["memory", "policy", "KV", "PPL", "drop vs window", "window-to-full gap closed",
                         "streaming-to-full gap closed"],
                        [[size_text((g["memory_kind"], g["memory"])), g["policy"], "INT8" if g["kv_int8"] else "FP",
                          g["ppl"], g["drop_vs_window"], f"{100 * g['window_gap_closed']:.1f}%",
                          f"{100 * g['streaming_gap_closed']:.1f}%"] for g in gaps])
    for memory in ("mean_kv_bytes", "peak_kv_bytes"):
        png = plot_ppl_at_memory(rows, assets / f"{slug}_ppl_at_{memory.split('_')[0]}_memory.png",
                                 title=f"{first.get('model')}: perplexity at matched KV memory "
                                       f"(labels: {memory.split('_')[0]} KV)", memory=memory)
        lines += [f"![perplexity at matched KV memory, {memory.split('_')[0]} KV labels]({_rel(png, base)})", ""]
    for r in rows:
        if r["policy"] in ("confkv", "confkv-l") and r.get("trace_file"):
            trace_path = Path(r["trace_file"])
            if not trace_path.is_absolute() and not trace_path.exists():
                trace_path = path.parent / Path(r["trace_file"]).name
            data = _load_json(trace_path) if trace_path.exists() else None
            if data and "trace" in data:
                png = plot_trace(trace_from_dict(data["trace"]),
                                 assets / f"{slug}_trace_{r['policy']}_{'_'.join(map(str, memory_size(r) or ('full',)))}_"
                                          f"{int(bool(r.get('kv_int8')))}.png",
                                 title=f"{r['policy']} {json.dumps(r.get('params'))} int8={r.get('kv_int8')}: "
                                       f"PPL {r['ppl']:.2f}")
                lines += [f"Sawtooth trace, {r['policy']} {json.dumps(r.get('params'))}"
                          f"{' INT8' if r.get('kv_int8') else ''}:", "", f"![trace]({_rel(png, base)})", ""]
    return lines


def _ppl_section(files: list[tuple[Path, dict]], base: Path, assets: Path) -> list[str]:
    from confkv.eval.report.plots import plot_trace, trace_from_dict

    if not files:
        return []
    lines = ["## Single perplexity runs (`confkv ppl --out`)", ""]
    table = []
    for path, data in files:
        s = data["summary"]
        table.append([_rel(path, base), s.get("policy"), json.dumps(s.get("params", {})), s.get("kv_int8"),
                      s.get("tokens"), s.get("ppl"), s.get("peak_kv_bytes", 0) / 1e6, s.get("mean_kv_bytes", 0) / 1e6])
    lines += _table(["file", "policy", "params", "INT8", "tokens", "PPL", "peak MB", "mean MB"], table)
    for path, data in files:
        png = path.with_suffix(".png")
        if not png.exists():
            png = plot_trace(trace_from_dict(data["trace"]), assets / (_rel(path, base).replace("/", "_") + ".png"),
                             title=f"{data['summary'].get('policy')}: PPL {data['summary'].get('ppl', float('nan')):.2f}")
        lines += [f"![trace of {_rel(path, base)}]({_rel(png, base)})", ""]
    return lines


def _niah_memory(config: dict) -> str:
    """How a NIAH grid set memory: a target the cache held, or (grids made before it) a matched budget."""
    if "budget_fraction" not in config:
        return (f"each cache held {config['memory']:.1%} of the full cache's bytes at the end of every step "
                "(a memory target)")
    return (f"budget {config['budget_fraction']:.0%} of the full KV bytes of "
            + (f"{config['budget_tokens']} tokens" if config.get("budget_tokens") else f"the {config['budget_of']} context")
            + " (matched offline, before the memory target)")


def _niah_section(path: Path, data: dict, base: Path, assets: Path) -> list[str]:
    from confkv.eval.niah import plot_niah

    config = data["config"]
    lines = [f"### NIAH `{_rel(path, base)}`", "",
             f"Model `{data.get('model')}`, haystack `{config['haystack']}`, lengths {config['lengths']}, "
             f"depths {config['depths']}, {config['trials']} trial(s); " + _niah_memory(config)
             + ". Exact match of the first number generated; `vs full` = accuracy / full-KV accuracy on the same "
             "samples; `n` = generations scored.", ""]
    table = []
    for protocol in config["protocols"]:
        for policy in config["policies"]:
            per_length = [data["summary"].get(f"{policy}/{protocol}")]
            recs = [r for r in data["records"] if r["policy"] == policy and r["protocol"] == protocol]
            for length in config["lengths"]:
                sel = [r["correct"] for r in recs if r["length"] == length]
                per_length.append(sum(sel) / len(sel) if sel else float("nan"))
            params = data["budgets"].get(f"{policy}@{config['lengths'][-1]}", {})
            key = f"{policy}/{protocol}"
            table.append([protocol, policy, json.dumps(params), per_length[0],
                          data.get("relative_to_full", {}).get(key, float("nan")), data.get("counts", {}).get(key, len(recs)),
                          *per_length[1:]])
    lines += _table(["protocol", "policy", "params (longest)", "accuracy", "vs full", "n",
                     *[str(v) for v in config["lengths"]]], table)
    png = path.parent / "niah_heatmap.png"
    if not png.exists():
        png = plot_niah(data, assets / (_rel(path, base).replace("/", "_") + "_heatmap.png"))
    lines += [f"![NIAH heatmap]({_rel(png, base)})", ""]
    return lines


def _probe_section(path: Path, data: dict, base: Path, assets: Path) -> list[str]:
    meta = data.get("meta", {})
    if meta.get("mode") == "keep-recent":
        evicted = (f"everything but the first {meta.get('sinks')} tokens and the k tokens just before the current "
                   "one is evicted (the keep-recent reading)")
    else:
        evicted = "the k tokens just before the current one are evicted"
    lines = [f"### Probe `{_rel(path, base)}`", "",
             f"Model `{meta.get('model')}`, corpus `{meta.get('corpus')}`, {meta.get('tokens')} tokens. Per step: "
             f"confidence c of the full-KV next-token distribution vs KL(full || evicted) when {evicted}.", ""]
    table = []
    for r in data["results"]:
        s = r["summary"]
        ci = s.get("pearson_ci95", [float("nan")] * 2)
        table.append([s["k"], s["steps"], s["pearson_r"], f"[{ci[0]:.3f}, {ci[1]:.3f}]", s.get("pearson_r_log_kl"),
                      s.get("spearman_rho"), s["mean_kl"], s["ppl_full"], s["ppl_evict"]])
    lines += _table(["k", "steps", "Pearson r", "95% CI", "r (log KL)", "Spearman", "mean KL", "PPL full",
                     "PPL evicted"], table)
    quintiles = [(r["summary"]["k"], r["summary"].get("kl_by_confidence_quintile")) for r in data["results"]]
    if all(q for _, q in quintiles):
        lines += ["KL by confidence quintile (least confident first), median / mean:", ""]
        lines += _table(["k", *[f"Q{i}" for i in range(1, 6)]],
                        [[k, *[f"{row['median_kl']:.4f} / {row['mean_kl']:.4f}" for row in q]] for k, q in quintiles])
    png = path.parent / "probe.png"
    if not png.exists():
        from confkv.eval.quality.probe import ProbeResult, plot_probe
        import torch

        results = []
        for r in data["results"]:
            pr = ProbeResult(k=r["summary"]["k"], positions=torch.tensor(r["positions"]),
                             confidence=torch.tensor(r["confidence"]), kl=torch.tensor(r["kl"], dtype=torch.float64),
                             nll_full=torch.tensor(r["nll_full"]), nll_evict=torch.tensor(r["nll_evict"]),
                             confidence_evict=torch.tensor(r["confidence_evict"]))
            pr.stats = r["summary"]
            results.append(pr)
        png = plot_probe(results, assets / (_rel(path, base).replace("/", "_") + ".png"))
    lines += [f"![probe scatter]({_rel(png, base)})", ""]
    return lines


def build_report(results: str | Path, out: str | Path | None = None, html_too: bool = False, *,
                 html: bool | None = None, title: str = "confkv results") -> Path:
    """Write the report page and return its path (``<results>/REPORT.md`` by default)."""
    results = Path(results)
    out = Path(out) if out is not None else results / "REPORT.md"
    base = out.parent
    base.mkdir(parents=True, exist_ok=True)
    assets = base / "report_assets"
    want_html = html_too if html is None else html
    sweeps, niahs, probes, ppls = [], [], [], []
    for path in sorted(results.rglob("*")):
        if not path.is_file() or assets in path.parents:
            continue
        if path.suffix == ".jsonl":
            sweeps.append(path)
        elif path.suffix == ".json":
            if path.name == "niah.json":
                data = _load_json(path)
                if data and "grids" in data:
                    niahs.append((path, data))
            elif path.name == "probe.json":
                data = _load_json(path)
                if data and "results" in data:
                    probes.append((path, data))
            elif "traces" not in path.parts:
                data = _load_json(path)
                if isinstance(data, dict) and "summary" in data and "trace" in data and "ppl" in data["summary"]:
                    ppls.append((path, data))
    lines = [f"# {title}", "", f"Generated by `confkv report {results}` from the files under `{results}`.", ""]
    sweep_lines = [line for p in sweeps for line in _sweep_section(p, base, assets)]
    if sweep_lines:
        lines += ["## Perplexity at matched KV memory", ""] + sweep_lines
    lines += _ppl_section(ppls, base, assets)
    if niahs:
        lines += ["## Needle in a haystack", ""] + [x for p, d in niahs for x in _niah_section(p, d, base, assets)]
    if probes:
        lines += ["## Confidence vs KL shift (probe)", ""] + [x for p, d in probes for x in _probe_section(p, d, base, assets)]
    if len(lines) == 4:
        lines += ["(no result files found)", ""]
    out.write_text("\n".join(lines))
    if want_html:
        out.with_suffix(".html").write_text(markdown_to_html("\n".join(lines), title))
    return out


def markdown_to_html(text: str, title: str = "") -> str:
    """A small converter for the constructs this report writes (headings, tables, images, paragraphs)."""
    import re

    def inline(s: str) -> str:
        s = html.escape(s)
        s = re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", r'<img alt="\1" src="\2" style="max-width:100%">', s)
        s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
        return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", s)

    body, table = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            if not re.match(r"^\|(-+\|)+$", line):
                table.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
            continue
        if table:
            head, *rest = table
            body.append("<table border=1 cellspacing=0 cellpadding=3><tr>" + "".join(f"<th>{inline(c)}</th>" for c in head)
                        + "</tr>" + "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in row) + "</tr>" for row in rest)
                        + "</table>")
            table = []
        match = re.match(r"^(#+) (.*)$", line)
        if match:
            level = len(match.group(1))
            body.append(f"<h{level}>{inline(match.group(2))}</h{level}>")
        elif line.strip():
            body.append(f"<p>{inline(line)}</p>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family:sans-serif;max-width:1100px;margin:auto'>{''.join(body)}</body></html>")
