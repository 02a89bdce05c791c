"""Draw step time and peak memory per system from bench.py's JSON files.

python bench/plot.py bench-375m.json bench-1b.json bench-8b.json --out bench.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out", default="bench.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(f).read_text()) for f in args.files]
    results = [r for run in runs for r in run["results"]]
    models = list(dict.fromkeys(r["model"] for r in results))
    systems = list(dict.fromkeys(r["system"] for r in results))
    meta = runs[0]["meta"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(systems)
    for ax, key, label in ((axes[0], "step_ms", "step time (ms)"), (axes[1], "peak_gib", "peak memory (GiB)")):
        for i, system in enumerate(systems):
            values = [next((r[key] for r in results if r["model"] == m and r["system"] == system), 0) for m in models]
            bars = ax.bar([j + i * width for j in range(len(models))], values, width, label=system)
            ax.bar_label(bars, fmt="%.0f" if key == "step_ms" else "%.1f", fontsize=7)
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(models))], models)
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(f"{meta['gpus']} x {meta['device']}, torch {meta['torch']}, NCCL {meta['nccl']}, seq 2048, bf16")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
