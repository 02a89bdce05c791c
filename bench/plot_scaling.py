"""Per-GPU throughput and peak memory against GPU count, from bench.py's JSON
files of runs at several world sizes; prints a table with the scaling
efficiency (tokens/s per GPU at N GPUs over that at 2).

    python bench/plot_scaling.py bench1-1b.json bench-1b.json bench-8b.json --out scaling.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out", default="scaling.png")
    args = parser.parse_args()
    runs = [json.loads(Path(f).read_text()) for f in args.files]
    results = [r for run in runs for r in run["results"] if not run["meta"].get("fake_world")]
    series: dict[tuple[str, str], dict[int, dict]] = {}
    for r in results:
        series.setdefault((r["model"], r["system"]), {})[r["world_size"]] = r
    print("| model | system | GPUs | tokens/s/GPU | TFLOP/s/GPU | peak GiB | efficiency vs 2 GPUs |")
    print("|---|---|---|---|---|---|---|")
    for (model, system), by_n in sorted(series.items()):
        base = by_n.get(2)
        for n, r in sorted(by_n.items()):
            eff = f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.3f}" if base else "-"
            print(
                f"| {model} | {system} | {n} | {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.0f} | "
                f"{r['peak_gib']:.2f} | {eff} |"
            )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (model, system), by_n in sorted(series.items()):
        ns = sorted(by_n)
        if len(ns) < 2:  # a single GPU count is in the table, not a line
            continue
        for ax, key in ((axes[0], "tokens_per_s_per_gpu"), (axes[1], "peak_gib")):
            ax.plot(ns, [by_n[n][key] for n in ns], marker="o", label=f"{model} {system}")
    for ax, label in ((axes[0], "tokens/s per GPU"), (axes[1], "peak memory (GiB)")):
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({n for by_n in series.values() if len(by_n) > 1 for n in by_n}))
    axes[0].legend(fontsize=7)
    meta = runs[0]["meta"]
    fig.suptitle(f"{meta['device']}, torch {meta['torch']}, NCCL {meta['nccl']}, seq 2048, bf16")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
