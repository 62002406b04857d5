"""Figures of the validation experiment (registered with the report writer as kind "training").

Reads only the result's records: held-out accuracy against sampled tokens (mean over seeds,
band = one std), and gradient-norm traces per run.
"""

from __future__ import annotations

from pathlib import Path

from varbench.report.figures import FIGURES, subplots


def training_figures(result, fig_dir: Path, prefix: str) -> list[tuple[str, str]]:
    """Accuracy-vs-tokens curves per task and gradient-norm traces; returns (file, caption)."""
    out = []
    curves = result.records.get("curves_mean")
    if curves is not None and len(curves):
        tasks = list(dict.fromkeys(curves["task"]))
        fig, axes = subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
        thr = result.summary.get("thresholds", {})
        for ax, task in zip(axes[0], tasks, strict=True):
            d = curves[curves["task"] == task]
            for (scheme, G), c in d.groupby(["scheme", "G"]):
                c = c.sort_values("tokens")
                line = ax.plot(c["tokens"], c["acc_mean"], label=f"{scheme} G={G}")[0]
                std = c["acc_std"].fillna(0)
                ax.fill_between(c["tokens"], c["acc_mean"] - std, c["acc_mean"] + std,
                                color=line.get_color(), alpha=0.12)
            if task in thr:
                ax.axhline(thr[task], color="k", ls=":", lw=1, label="threshold")
            ax.set_xlabel("sampled tokens (policy-generated)")
            ax.set_ylabel("held-out exact-match accuracy (sampled)")
            ax.set_title(task)
            ax.legend(fontsize=7)
        name = f"{prefix}accuracy_vs_tokens.png"
        fig.tight_layout()
        fig.savefig(fig_dir / name, dpi=110)
        out.append((name, "Held-out accuracy against sampled tokens, mean over seeds "
                          "(band: 1 std)."))
    traces = result.records.get("grad_traces")
    if traces is not None and len(traces):
        tasks = list(dict.fromkeys(traces["task"]))
        fig, axes = subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
        for ax, task in zip(axes[0], tasks, strict=True):
            d = traces[traces["task"] == task]
            for (scheme, G, seed), c in d.groupby(["scheme", "G", "seed"]):
                ax.plot(c["tokens"], c["grad_norm"], lw=0.7, alpha=0.7,
                        label=f"{scheme} G={G}" if seed == d["seed"].min() else None)
            ax.set_yscale("log")
            ax.set_xlabel("sampled tokens")
            ax.set_ylabel("gradient norm before clipping")
            ax.set_title(task)
            ax.legend(fontsize=7)
        name = f"{prefix}grad_norm_traces.png"
        fig.tight_layout()
        fig.savefig(fig_dir / name, dpi=110)
        out.append((name, "Gradient-norm traces per run (a collapse shows as a surge)."))
    return out


FIGURES.setdefault("training", training_figures)
