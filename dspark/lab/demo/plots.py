"""The demo's PNGs: throughput vs batch, predicted vs actual tau, verify-length histogram.

Reliability diagrams come from dspark.calibration.plots."""
from __future__ import annotations

from pathlib import Path

from dspark.telemetry import StepRecord


def write_plots(out: Path, rows: list[dict], records: dict[tuple[str, int], list[StepRecord]]) -> list[Path]:
    """Write the PNGs into `out`; returns their paths (none when matplotlib is missing)."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)

    fig, (ax, rel) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        style = "-o" if policy in ("adaptive", "adaptive-est", "oracle") else "--."
        lw = 2 if policy == "adaptive" else 1
        ax.plot([r["batch"] for r in mine], [r["tokens_per_s"] for r in mine], style, label=policy, lw=lw)
        rel.plot([r["batch"] for r in mine], [r["speedup_vs_no_spec"] for r in mine], style, label=policy, lw=lw)
    ax.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="committed tokens / s (whole queue)",
           title="throughput vs batch size")
    rel.set(xscale="log", xlabel="batch size B", ylabel="speed-up over fixed-0 (median of per-round ratios)",
            title="speed-up over plain decoding, same lockstep round")
    rel.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.legend(fontsize=7, ncol=2)
    save(fig, "throughput_vs_batch.png")

    fig, ax = plt.subplots(figsize=(5, 5))
    for (policy, b), recs in records.items():
        if policy == "adaptive":
            ax.scatter([r.predicted_tau / r.batch for r in recs], [r.committed / r.batch for r in recs],
                       s=6, alpha=0.5, label=f"B={b}")
    lim = [1, max(2.0, max((r["acceptance_length"] for r in rows), default=2) + 1)]
    ax.plot(lim, lim, "k:", lw=1)
    ax.set(xlabel="predicted tau / B", ylabel="committed tokens / B", title="adaptive: predicted vs actual tau")
    ax.legend(fontsize=7)
    save(fig, "tau_predicted_vs_actual.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for (policy, b), recs in records.items():
        if policy == "adaptive":
            lens = [v for r in recs for v in r.verify_lens]
            top = max(lens, default=1)
            ax.hist(lens, bins=[x - 0.5 for x in range(1, top + 2)], histtype="step", density=True, label=f"B={b}")
    ax.set(xlabel="verify length (rows, root included)", ylabel="fraction of request-steps",
           title="adaptive: verify-length histogram")
    ax.legend(fontsize=7)
    save(fig, "verify_length_hist.png")

    return paths
