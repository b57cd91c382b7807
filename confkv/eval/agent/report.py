"""The agent grid's tables and plot: ``agent.md`` and ``agent.png`` from ``agent.jsonl``'s records.

Besides :func:`confkv.eval.agent.grid.summarize`'s rows (one per protocol x policy x compression),
two views say *what* a compressed cache lost:

- **per template** (teacher-forced): agreement with full KV's own predictions, by task template;
- **typed-value recall** (teacher-forced): at every expert step that types a value (a promo
  code, a ticket code, an amount, a name: most of them read pages earlier in the history), is
  that value anywhere in the policy's generated action text? Full KV's recall is the reference,
  so a policy that drops the page holding the code shows it here even when the model formats
  its actions badly (the agreement scores need the whole action right);
- **lost values** (teacher-forced): each typed value that full KV's action contains and the
  policy's does not, with what the policy typed instead: the information its cache lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from confkv.eval.agent.actions import parse_action
from confkv.eval.agent.grid import _agreement, _mean


def typed_values(record: dict[str, Any]) -> list[tuple[str, str]]:
    """(expert's typed value, the policy's raw generated text) for each expert ``type`` step of a
    teacher-forced record."""
    pairs = []
    for step in record.get("steps", []):
        expert = parse_action(step["expert"])
        if expert.kind == "type" and expert.text:
            pairs.append((expert.text, step.get("raw", "")))
    return pairs


def value_recall(record: dict[str, Any]) -> float | None:
    """Fraction of the record's typed-value steps whose value appears in the generated text
    (case-insensitive); None when the record has no such step."""
    pairs = typed_values(record)
    if not pairs:
        return None
    return sum(value.lower() in raw.lower() for value, raw in pairs) / len(pairs)


def lost_values(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Teacher-forced steps where full KV's generated text contains the value the expert types and the
    policy's (same task, same step) does not: policy, compression, task, step, value, the policy's text."""
    tf = [r for r in records if r["protocol"] == "teacher-forced"]
    full = {r["task"]: r for r in tf if r["policy"] == "full"}
    lost = []
    for r in sorted(tf, key=lambda r: (r["compression"], r["policy"], r["task"])):
        reference = full.get(r["task"])
        if r["policy"] == "full" or reference is None:
            continue
        for index, (mine, theirs) in enumerate(zip(r["steps"], reference["steps"])):
            expert = parse_action(theirs["expert"])
            if expert.kind != "type" or not expert.text:
                continue
            value = expert.text.lower()
            if value in theirs.get("raw", "").lower() and value not in mine.get("raw", "").lower():
                lost.append({"policy": r["policy"], "compression": r["compression"], "task": r["task"], "step": index,
                             "value": expert.text, "typed": mine.get("raw", "")})
    return lost


def _label(policy: str, compression: float) -> str:
    return "full" if policy == "full" else f"{policy} x{compression:.3g}"


def teacher_forced_views(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (policy, compression): agreement with full by template, and typed-value recall
    (absolute, and relative to full's on the same tasks)."""
    tf = [r for r in records if r["protocol"] == "teacher-forced"]
    full = {r["task"]: r for r in tf if r["policy"] == "full"}
    templates = sorted({r["template"] for r in tf})
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in tf:
        groups.setdefault((r["policy"], r["compression"]), []).append(r)
    rows = []
    for (policy, compression), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0] != "full", kv[0][0])):
        paired = [(r, full[r["task"]]) for r in rs if r["task"] in full]
        by_template = {t: _mean([_agreement([s["predicted"] for s in r["steps"]], [s["predicted"] for s in f["steps"]])
                                 for r, f in paired if r["template"] == t]) for t in templates}
        mine = _mean([value_recall(r) for r, f in paired if value_recall(f) is not None])
        ref = _mean([value_recall(f) for r, f in paired if value_recall(f) is not None])
        rows.append({"policy": policy, "compression": compression, "tasks": len(rs), "by_template": by_template,
                     "value_recall": _mean([value_recall(r) for r in rs]),
                     "value_recall_vs_full": mine / ref if ref else None})
    return {"templates": templates, "rows": rows}


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def agent_markdown(summary: list[dict[str, Any]], records: list[dict[str, Any]], command: str = "") -> str:
    """``agent.md``: the command, the summary table, and the teacher-forced views."""
    lines = ["# Agent workload results", ""]
    if command:
        lines += ["Written by:", "", "```bash", command, "```", ""]
    lines += ["| protocol | policy | compression | tasks | agree (expert) | vs full | agree (full) | success | "
              "success vs full | peak KV MB | full / peak | mean KV MB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['protocol']} | {r['policy']} | {r['compression']:.3g} | {r['tasks']} | "
                     f"{_f(r.get('agree_expert'), 3)} | {_f(r.get('agree_expert_vs_full'))} | "
                     f"{_f(r.get('agree_full'), 3)} | {_f(r.get('success'), 3)} | {_f(r.get('success_vs_full'))} | "
                     f"{r['peak_kv_bytes'] / 1e6:.1f} | {_f(r.get('peak_vs_full'))} | {r['mean_kv_bytes'] / 1e6:.1f} |")
    views = teacher_forced_views(records)
    if views["rows"]:
        templates = views["templates"]
        lines += ["", "## Teacher-forced: agreement with full KV by task template", "",
                  "| policy | " + " | ".join(templates) + " | typed-value recall | recall vs full |",
                  "|---|" + "---|" * (len(templates) + 2)]
        for r in views["rows"]:
            cells = " | ".join(_f(r["by_template"][t]) for t in templates)
            lines.append(f"| {_label(r['policy'], r['compression'])} | {cells} | {_f(r['value_recall'])} | "
                         f"{_f(r['value_recall_vs_full'])} |")
        lines += ["", "Typed-value recall: at each expert step that types a value (a code, an amount, a name), "
                  "whether that value is in the generated action text (`confkv.eval.agent.report`)."]
        lost = lost_values(records)
        lines += ["", "## Teacher-forced: values full KV typed and a policy lost", ""]
        if lost:
            lines += ["| policy | task | step | value (expert, full KV) | the policy's action |", "|---|---|---|---|---|"]
            lines += [f"| {_label(x['policy'], x['compression'])} | {x['task']} | {x['step']} | {x['value']} | "
                      f"{x['typed'].replace('|', '/')} |" for x in lost]
        else:
            lines.append("None: every value full KV typed, every policy typed too (or full typed none).")
    return "\n".join(lines) + "\n"


def plot_agent(summary: list[dict[str, Any]], records: list[dict[str, Any]], path: str | Path) -> Path:
    """``agent.png``: teacher-forced agreement with full KV (left) and typed-value recall relative
    to full (right) against the measured compression (full KV's peak / the policy's peak, averaged
    over tasks), one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recall = {(r["policy"], r["compression"]): r["value_recall_vs_full"] for r in teacher_forced_views(records)["rows"]}
    tf = [r for r in summary if r["protocol"] == "teacher-forced"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for policy in sorted({r["policy"] for r in tf if r["policy"] != "full"}):
        rows = sorted((r for r in tf if r["policy"] == policy), key=lambda r: r["compression"])
        # x: the measured compression (full KV's peak / the policy's), not the requested one
        xs = [1.0] + [r.get("peak_vs_full") or r["compression"] for r in rows]
        axes[0].plot(xs, [1.0] + [r.get("agree_full") for r in rows], marker="o", label=policy)
        ys = [recall.get((policy, r["compression"])) for r in rows]
        if any(y is not None for y in ys):
            axes[1].plot(xs, [1.0] + ys, marker="o", label=policy)
    if not axes[1].lines:
        axes[1].text(0.5, 0.5, "full KV never typed an expected value:\nno recall to compare", ha="center",
                     va="center", transform=axes[1].transAxes, fontsize=9)
    for ax, title in zip(axes, ("next-action agreement with full KV", "typed-value recall / full KV's")):
        ax.set_xlabel("measured compression (full KV peak bytes / policy peak bytes)")
        ax.set_title(title, fontsize=10)
        ax.axhline(0.95, color="grey", linestyle=":", linewidth=1)
        ax.set_ylim(0, 1.15)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_agent_report(summary: list[dict[str, Any]], records: list[dict[str, Any]], out_dir: str | Path,
                       command: str = "") -> list[Path]:
    """Write ``agent.md`` and ``agent.png`` into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    md = out_dir / "agent.md"
    md.write_text(agent_markdown(summary, records, command) + "\n![agreement and recall vs compression](agent.png)\n")
    return [md, plot_agent(summary, records, out_dir / "agent.png")]


__all__ = ["agent_markdown", "lost_values", "plot_agent", "teacher_forced_views", "typed_values", "value_recall",
           "write_agent_report"]
