"""Figures drawn from analysis records (matplotlib, PNG).

One function per analysis kind; each reads only ``result.records`` and returns a list of
``(file name, caption)`` for the figures it wrote into ``fig_dir``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure as _MplFigure

from varbench._util.checks import UsageError

Figure = tuple[str, str]


def subplots(nrows: int = 1, ncols: int = 1, *, figsize=None, **kwargs):
    """``(figure, axes)`` like ``pyplot.subplots`` but without pyplot.

    Figures are standalone ``matplotlib.figure.Figure`` objects saved straight to PNG, so
    importing varbench never selects a backend (a notebook's inline backend keeps working) and
    nothing accumulates in pyplot's figure registry.
    """
    fig = _MplFigure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, **kwargs)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _states(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["state"])) if "state" in df else ["policy"]


def proxy_figures(result, fig_dir: Path, prefix: str) -> list[Figure]:
    """Log-log scatter, correlation against position and calibration, one panel per state."""
    out: list[Figure] = []
    tok = result.records.get("tokens")
    if tok is not None and len(tok):
        states = _states(tok)
        fig, axes = subplots(1, len(states), figsize=(4.2 * len(states), 3.8), squeeze=False)
        for ax, st in zip(axes[0], states, strict=True):
            d = tok[tok["state"] == st]
            d = d[(d["w_t"] > 0) & (d["token_sq"] > 0)]
            ax.scatter(d["w_t"], d["token_sq"], s=4, alpha=0.4)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("proxy w_t = ||e_y - pi||^2")
            ax.set_ylabel("exact ||g_t||^2 (all parameters)")
            ax.set_title(st)
        name = f"{prefix}proxy_scatter.png"
        _save(fig, fig_dir / name)
        out.append((name, "Per-token proxy against the exact squared gradient norm (log-log)."))
    cor = result.records.get("correlations")
    if cor is not None and len(cor):
        pos = cor[(cor["scope"] == "position") & (cor["method"] == "spearman")]
        if len(pos):
            states = _states(pos)
            fig, axes = subplots(
                1, len(states), figsize=(4.2 * len(states), 3.8), squeeze=False
            )
            for ax, st in zip(axes[0], states, strict=True):
                d = pos[pos["state"] == st]
                for q in dict.fromkeys(d["quantity"]):
                    e = d[d["quantity"] == q].sort_values("position")
                    ax.plot(e["position"], e["estimate"], marker="o", label=q)
                    ax.fill_between(e["position"], e["ci_low"], e["ci_high"], alpha=0.2)
                ax.axhline(0, color="grey", lw=0.5)
                ax.set_ylim(-1, 1)
                ax.set_xlabel("response position t")
                ax.set_ylabel("Spearman within position (95% CI)")
                ax.set_title(st)
                ax.legend(fontsize=7)
            name = f"{prefix}proxy_by_position.png"
            _save(fig, fig_dir / name)
            out.append((name, "Rank correlation computed within each position across sequences."))
    cal = result.records.get("calibration")
    if cal is not None and len(cal):
        fig, ax = subplots(figsize=(4.8, 3.8))
        for st in _states(cal):
            d = cal[cal["state"] == st].sort_values("proxy_mean")
            ax.errorbar(d["proxy_mean"], d["true_mean"], yerr=d["true_se"], marker="o",
                        capsize=2, label=st)
        ax.set_yscale("log")
        ax.set_xlabel("proxy w_t (bin mean)")
        ax.set_ylabel("mean exact ||g_t||^2 in bin (+- SE)")
        ax.legend(fontsize=8)
        name = f"{prefix}proxy_calibration.png"
        _save(fig, fig_dir / name)
        out.append((name, "Calibration: binned proxy against the mean exact norm."))
    return out


def variance_figures(result, fig_dir: Path, prefix: str) -> list[Figure]:
    """Variance (log) against G per scheme, and variance x tokens against G."""
    cells = result.records.get("cells")
    if cells is None or not len(cells):
        return []
    out: list[Figure] = []
    modes = list(dict.fromkeys(cells["mode"]))
    for col, label, fname in (
        ("variance", "total variance tr Cov(g_hat)", "variance_vs_G.png"),
        ("variance_x_tokens", "variance x tokens sampled per group", "variance_tokens_vs_G.png"),
    ):
        fig, axes = subplots(1, len(modes), figsize=(5 * len(modes), 4), squeeze=False)
        for ax, mode in zip(axes[0], modes, strict=True):
            d = cells[cells["mode"] == mode]
            for scheme in dict.fromkeys(d["scheme"]):
                e = d[d["scheme"] == scheme].sort_values("G")
                ax.errorbar(e["G"], e[col], yerr=e[f"{col}_se"], marker="o", capsize=2,
                            label=scheme)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("group size G")
            ax.set_ylabel(label)
            ax.set_title(f"aggregation: {mode}")
            ax.legend(fontsize=7)
        name = f"{prefix}{fname}"
        _save(fig, fig_dir / name)
        out.append((name, f"{label} against G per scheme (+- jackknife SE)."))
    return out


def cancellation_figures(result, fig_dir: Path, prefix: str) -> list[Figure]:
    """Mean shared-step residual per configuration, and net weight of the frequent token ids."""
    out: list[Figure] = []
    conf = result.records.get("configs")
    if conf is not None and len(conf):
        tasks = list(dict.fromkeys(conf["task"]))
        fig, axes = subplots(
            1, len(tasks), figsize=(8 * len(tasks), 0.3 * conf.groupby("task").size().max() + 1.5),
            squeeze=False,
        )
        for ax, task in zip(axes[0], tasks, strict=True):
            d = conf[conf["task"] == task]
            y = np.arange(len(d))
            ax.barh(y - 0.2, d["full_residual_rel"], height=0.4, xerr=d["full_residual_rel_se"],
                    label="full-group shared steps")
            ax.barh(y + 0.2, d["shared_residual_rel"], height=0.4,
                    xerr=d["shared_residual_rel_se"], label="all shared steps")
            ax.set_yticks(y)
            ax.set_yticklabels(d["config"], fontsize=7)
            ax.set_xlabel("|sum c_i A_i| / sum |c_i A_i| at shared steps (mean +- SE)")
            ax.set_title(f"task: {task}")
            ax.legend(fontsize=7)
        name = f"{prefix}cancellation_residual.png"
        _save(fig, fig_dir / name)
        out.append((name, "Relative residual at shared steps: 0 means exact cancellation."))
    tid = result.records.get("token_ids")
    if tid is not None and len(tid):
        d = tid[tid["config"] == tid["config"].iloc[0]]
        d = d[d["task"] == d["task"].iloc[0]].head(15)
        fig, ax = subplots(figsize=(6, 3.8))
        ax.bar(d["token_str"].astype(str), d["net_weight"])
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("token (most frequent first)")
        ax.set_ylabel("net weight sum c_i A_i")
        ax.set_title(f"{d['task'].iloc[0]}: {d['config'].iloc[0]}")
        name = f"{prefix}cancellation_token_net.png"
        _save(fig, fig_dir / name)
        out.append((name, "Signed net coefficient per token id (approximate: contexts differ)."))
    return out


def training_figures(result, fig_dir: Path, prefix: str) -> list[tuple[str, str]]:
    """Validation experiment: accuracy-vs-tokens curves per task and gradient-norm traces."""
    out = []
    curves = result.records.get("curves_mean")
    if curves is not None and len(curves):
        tasks = list(dict.fromkeys(curves["task"]))
        fig, axes = subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
        thr = result.summary.get("thresholds", {})
        for ax, task in zip(axes[0], tasks, strict=True):
            d = curves[curves["task"] == task]
            for i, ((scheme, G), c) in enumerate(d.groupby(["scheme", "G"])):
                c = c.sort_values("tokens")  # past 10 arms the colours repeat: vary the dash
                line = ax.plot(c["tokens"], c["acc_mean"], label=f"{scheme} G={G}",
                               ls=("-", "--", ":")[(i // 10) % 3])[0]
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
        _save(fig, fig_dir / name)
        out.append((name, "Held-out accuracy against sampled tokens, mean over seeds on a "
                          "common token grid up to the shortest run of each arm (band: 1 std)."))
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
        _save(fig, fig_dir / name)
        out.append((name, "Gradient-norm traces per run (a collapse shows as a surge)."))
    out += _in_run_figures(result.records.get("steps"), fig_dir, prefix)
    return out


_VARIANCE_METRICS = ("grad_var_split", "grad_sq_batch")
_FIDELITY_METRICS = ("proxy_seq_spearman", "proxy_exact_corr", "verl_proxy_spearman")


def _in_run_figures(steps, fig_dir: Path, prefix: str) -> list[tuple[str, str]]:
    """In-run records (the TRL callback, verl batches): the gradient variance and the proxy's
    fidelity against the optimizer step."""
    if steps is None or not len(steps) or "metric" not in steps:
        return []
    have = set(steps["metric"])
    panels = [m for m in (_VARIANCE_METRICS, _FIDELITY_METRICS) if have & set(m)]
    if not panels:
        return []
    fig, axes = subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, metrics in zip(axes[0], panels, strict=True):
        for metric in metrics:
            d = steps[steps["metric"] == metric].sort_values("step")
            if len(d):
                ax.plot(d["step"], d["value"], marker=".", label=metric)
        if metrics is _VARIANCE_METRICS:
            ax.set_yscale("log")
            ax.set_ylabel("split-half tr Cov(g) and ||g||^2")
        else:
            ax.set_ylim(-1.05, 1.05)
            ax.set_ylabel("correlation of the proxy with exact norms")
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=7)
    name = f"{prefix}in_run.png"
    _save(fig, fig_dir / name)
    return [(name, "Measured in the run: the gradient estimate's variance (split-half) and the "
                   "proxy's fidelity, per measured batch.")]


FIGURES: dict[str, Callable[..., list[Figure]]] = {"training": training_figures}
"""``{result kind: figures(result, fig_dir, prefix)}``: what :func:`~varbench.report.writer.
write_report` draws. Training's is here; each analysis kind's is the ``figures`` of its
declaration, entered by :func:`varbench.analysis.kinds.register_analysis` (the report package
cannot import the analyses)."""


def register_figures(kind: str, draw: Callable[..., list[Figure]]) -> None:
    """Draw ``draw(result, fig_dir, prefix)`` for every result of ``kind`` in a report."""
    if kind in FIGURES and FIGURES[kind] is not draw:
        raise UsageError(f"figures of result kind {kind!r} are already registered")
    FIGURES[kind] = draw
