"""The server's RSS against requests ended, from a ``serve_load`` JSON (``rss_by_requests``).

Usage: ``python benchmarks/serve_rss_plot.py results/serve/flat_smollm2_1000.json [--after 100]``
writes the PNG beside the JSON (same name, ``.png``): the RSS after each request, the level after the
first ``--after`` requests, and the +-5% band the flat-memory check allows around it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path)
    parser.add_argument("--after", type=int, default=100)
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    samples = result.get("rss_by_requests") or []
    if len(samples) <= args.after:
        parser.error(f"{args.result}: {len(samples)} RSS samples, need more than --after {args.after}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ended = [n for n, _ in samples]
    rss = [b / 2**20 for _, b in samples]
    level = rss[args.after - 1]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(ended, rss, lw=0.8, label="server RSS when a request ends")
    ax.axhline(level, color="k", lw=0.8, ls="--", label=f"after {args.after} requests")
    ax.axhspan(level * 0.95, level * 1.05, color="tab:green", alpha=0.12, label="within 5%")
    ax.set_xlabel("requests ended")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(f"confkv serve: {result['requests']} requests, {result['clients']} clients, memory {result['memory']}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = args.result.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
