"""The figure of ``rpcps bench scale --plot``: throughput against trainer hosts, one panel per
case, a line per server count (each count's median round), and the ideal (trainer hosts x one
process on one host) beside."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.core.scale.bench import medians


def draw(summary: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'rpcps[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = summary["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
    for ax, (name, result) in zip(axes[0], results.items()):
        runs = medians(result["runs"])
        unit = runs[0]["unit"] if runs else "samples"
        counts = sorted({r["trainers"] for r in runs})
        ax.plot(counts, [n * result["baseline"] for n in counts], "k--", label="ideal (hosts x one process)")
        for servers in sorted({r["servers"] for r in runs}):
            mine = sorted((r["trainers"], r["per_s"]) for r in runs if r["servers"] == servers)
            ax.plot([t for t, _ in mine], [v for _, v in mine], "o-", label=f"{servers} server host(s)")
        ax.set_title(name)
        ax.set_xlabel("trainer hosts")
        ax.set_ylabel(f"{unit}/s")
        ax.set_xticks(counts)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    cpus = summary["config"]["cpus"]
    fig.suptitle(f"rpcps bench scale: every host {cpus} cores, each member on a host of its own", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
