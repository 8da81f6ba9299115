"""Reliability diagrams (one PNG per draft position) from a fitted `Calibration` (matplotlib, lazy import)."""
from __future__ import annotations

import os
from pathlib import Path

from dspark.calibration.fit import Calibration
from dspark.util.fileio import atomic_write


def plot_reliability(calib: Calibration, out_dir: str | os.PathLike, event: str = "cumulative") -> list[Path]:
    """Write `reliability_pos<k>.png` per position: held-out observed frequency vs mean predicted, before/after
    STS, over a histogram of the after-STS bin counts (how many rows each point rests on)."""
    if event not in ("cumulative", "conditional"):
        raise ValueError(f"event must be 'cumulative' or 'conditional', got {event!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for pos in calib.metrics.get("positions", []):
        rep = pos.get(event)
        if rep is None:
            continue
        k = pos["position"]
        fig, (ax, hist) = plt.subplots(2, 1, figsize=(4.5, 5.6), sharex=True, height_ratios=(4, 1.3))
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="perfect")
        for stage, color in (("before", "tab:red"), ("after", "tab:blue")):
            rel = rep["reliability"][stage]
            pts = [(p, f) for p, f, c in zip(rel["mean_p"], rel["freq"], rel["count"]) if c]
            ece = rep[stage]["ece_width"]["value"]
            ax.plot([p for p, _ in pts], [f for _, f in pts], "o-", color=color, ms=4,
                    label=f"{stage} (ECE {ece:.4f})")
        ax.set(xlim=(0, 1), ylim=(0, 1), ylabel="observed frequency",
               title=f"{calib.policy}, draft {k}, {event} (T={calib.temperatures[k]:.3g}, n={rep['rows']})")
        ax.legend(loc="upper left", fontsize=8)
        after = rep["reliability"]["after"]
        bins = len(after["count"])
        hist.bar([(i + 0.5) / bins for i in range(bins)], after["count"], width=0.9 / bins, color="tab:blue")
        for i, c in enumerate(after["count"]):
            if c:
                hist.text((i + 0.5) / bins, c, str(c), ha="center", va="bottom", fontsize=6)
        hist.set(xlabel="predicted probability", ylabel="rows (after)")
        fig.tight_layout()
        paths.append(atomic_write(out / f"reliability_pos{k}.png", lambda tmp: fig.savefig(tmp, format="png", dpi=100)))
        plt.close(fig)
    return paths
