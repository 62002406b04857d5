"""Proxy-vs-true correlation (issue 5.1): how well w_t = ||e_y - pi||^2 tracks exact norms.

    res = proxy_correlation({"random init": p0, "warm-started": p1}, get_task("sort"))
    res.records["correlations"]   # state, quantity, scope, position, method, estimate, CI, se

For each policy state: sample G responses to each prompt; one forward gives the proxy w_t and
its cumulative W_t; the exact harness gives ``token_sq``, ``prefix_sq``, ``diag_prefix_sq`` and a
per-parameter-group breakdown (the ``head`` group is the head-only exact norm). Correlations
(Pearson raw and log, Spearman, Kendall) carry 95% bootstrap CIs resampling *sequences*.
Cumulative quantities are correlated pooled AND within each fixed position across sequences,
because pooled cumulative correlations are inflated by position alone (both grow with t).
Also: per-sequence W_T vs ||sum_t g_t||^2, a calibration table (binned proxy vs mean exact
norm), and how much the OTB baseline changes when the proxy replaces exact weights.

Data-parallel under ``torchrun`` (every rank must make the call): sampling is cheap and runs on
every rank with the same seed; the exact per-token norms, the expensive part, are computed for
the sequences ``b % world_size == rank`` only and the token records are gathered back in
one-process order, so every rank returns the same records as a one-process run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from varbench._util.checks import UsageError
from varbench._util.config import Config, knob, text
from varbench._util.distributed import gather_objects, rank_world
from varbench._util.progress import show_progress
from varbench.analysis._common import CellCache, concat, placement_of
from varbench.analysis.kinds import AnalysisKind, one_task, register_analysis
from varbench.analysis.plan import Plan
from varbench.estimators.otb import otb_baseline
from varbench.estimators.registry import advantages
from varbench.grads import forward_stats, token_grad_norms
from varbench.models.presets import Policy
from varbench.report.figures import proxy_figures
from varbench.report.headline import correlation_sentence, fmt
from varbench.report.provenance import provenance
from varbench.report.result import AnalysisResult, Headline
from varbench.rollout.external import (
    check_columns,
    rollout_batch,
    rollouts_key,
    rollouts_note,
)
from varbench.rollout.sampler import sample
from varbench.stats.estimates import MAGNITUDE_METHODS, correlations
from varbench.tasks.base import Task

_PAIRS_TOKEN = (("w_t", "token_sq"), ("w_t", "head_sq"))
_PAIRS_CUM = (("W_t", "diag_prefix_sq"), ("W_t", "prefix_sq"))


def token_records(policy: Policy, batch, *, state: str, progress: bool = False) -> pd.DataFrame:
    """One row per response token of ``batch``: proxy, cumulative proxy and exact norms.

    Columns: ``state, p, seq, pos`` (generated-token index), ``w_t, W_t, token_sq, prefix_sq,
    diag_prefix_sq, head_sq, h_sq`` and ``token_sq[<group>]`` per parameter group. ``head_sq``
    is NaN when the model has no separate head group (tied embeddings).
    """
    flat = batch.flat()
    model = policy.model
    dev = policy.device
    rank, world = rank_world()
    rows = torch.arange(rank, flat.input_ids.shape[0], world, device=dev)  # this rank's rows
    ids, resp, attn = (x.to(dev)[rows] for x in (flat.input_ids, flat.response_mask,
                                                 flat.attention_mask))
    fs = forward_stats(model, ids, resp, attn, hidden_norms=True)
    norms = token_grad_norms(model, ids, resp, attn, groups=True, progress=progress)
    m = resp != 0
    local, col = m.nonzero(as_tuple=True)
    b_idx = rows[local]
    pos = (m.long().cumsum(1) - 1)[local, col]
    G = batch.G
    names = norms.group_names or []
    # every column on the device, moved to the host in ONE transfer (float64 holds the
    # integer columns exactly)
    cols: dict[str, torch.Tensor] = {
        "p": b_idx // G, "seq": b_idx, "pos": pos,
        "w_t": fs.proxy[local, col], "W_t": fs.cum_proxy[local, col],
        "token_sq": norms.token_sq[local, col], "prefix_sq": norms.prefix_sq[local, col],
        "diag_prefix_sq": norms.diag_prefix_sq[local, col], "h_sq": fs.h_sq[local, col],
    }
    for k, g in enumerate(names):
        cols[f"token_sq[{g}]"] = norms.group_token_sq[local, col, k]
    cols["reward"] = batch.rewards.to(dev).reshape(-1)[b_idx]
    host = torch.stack([x.double() for x in cols.values()], 1).cpu().numpy()
    data: dict[str, Any] = {"state": state}
    for j, k in enumerate(cols):
        data[k] = host[:, j].astype(np.int64) if k in ("p", "seq", "pos") else host[:, j]
    data["head_sq"] = data["token_sq[head]"] if "head" in names else np.nan
    data["reward"] = data.pop("reward")  # the historical column order
    df = pd.DataFrame(data)
    if world > 1:  # back to one-process order: sequence-major, then position
        df = pd.concat(gather_objects(df), ignore_index=True)
        df = df.sort_values(["seq", "pos"], kind="stable", ignore_index=True)
    return df


def _corr_rows(x, y, sid, *, quantity, scope, position, n_boot, seed, methods=None):
    kw = {} if methods is None else {"methods": methods}
    df = correlations(x, y, sid, n_boot=n_boot, seed=seed, **kw)
    df.insert(0, "position", position)
    df.insert(0, "scope", scope)
    df.insert(0, "quantity", quantity)
    return df


def correlation_records(tok: pd.DataFrame, *, n_boot: int = 200, seed: int = 0) -> pd.DataFrame:
    """Correlations of one state's token records (see module docstring); tidy rows with CIs."""
    rows = []
    for a, b in _PAIRS_TOKEN + tuple(("w_t", c) for c in tok.columns if c.startswith("token_sq[")):
        if tok[b].isna().all():
            continue
        rows.append(_corr_rows(tok[a], tok[b], tok["seq"], quantity=f"{a} vs {b}",
                               scope="pooled", position=-1, n_boot=n_boot, seed=seed))
    for a, b in _PAIRS_CUM + (("w_t", "token_sq"),):
        if (a, b) != ("w_t", "token_sq"):
            rows.append(_corr_rows(tok[a], tok[b], tok["seq"], quantity=f"{a} vs {b}",
                                   scope="pooled", position=-1, n_boot=n_boot, seed=seed))
        for t, d in tok.groupby("pos"):
            if d["seq"].nunique() >= 4:
                rows.append(_corr_rows(d[a], d[b], d["seq"], quantity=f"{a} vs {b}",
                                       scope="position", position=int(t), n_boot=n_boot,
                                       seed=seed, methods=["pearson", "pearson_log", "spearman"]))
    # Magnitude beside ranks: OTB's baseline B = sum W G / sum W uses the weights linearly, so
    # a proxy with the right ranks but the wrong spread of magnitudes still moves B.
    rows.append(_corr_rows(tok["w_t"], tok["token_sq"], tok["seq"], quantity="w_t vs token_sq",
                           scope="magnitude", position=-1, n_boot=n_boot, seed=seed,
                           methods=list(MAGNITUDE_METHODS)))
    last = tok.loc[tok.groupby("seq")["pos"].idxmax()]
    rows.append(_corr_rows(last["W_t"], last["prefix_sq"], last["seq"],
                           quantity="W_T vs sequence_sq", scope="sequence", position=-1,
                           n_boot=n_boot, seed=seed))
    out = pd.concat(rows, ignore_index=True)
    out.insert(0, "state", tok["state"].iloc[0])
    return out


def calibration_records(tok: pd.DataFrame, *, n_bins: int = 10) -> pd.DataFrame:
    """Binned proxy (quantile bins) against the mean exact token norm, with SE per bin."""
    q = pd.qcut(tok["w_t"], q=min(n_bins, tok["w_t"].nunique()), labels=False, duplicates="drop")
    g = tok.assign(bin=q).groupby("bin")
    out = pd.DataFrame({
        "proxy_mean": g["w_t"].mean(),
        "true_mean": g["token_sq"].mean(),
        "true_se": g["token_sq"].std(ddof=1) / np.sqrt(g.size()),
        "n": g.size(),
    }).reset_index()
    out.insert(0, "state", tok["state"].iloc[0])
    return out


def otb_baseline_records(batch, tok: pd.DataFrame, *, state: str) -> pd.DataFrame:
    """Mean |B_proxy - B_exact| and |A_proxy - A_exact| over valid tokens (OTB,
    docs/science.md §2.2)."""
    mask = batch.mask != 0
    dev = mask.device
    exact_w = torch.zeros(batch.tokens.shape, dtype=torch.float64, device=dev)
    # rows follow mask order
    exact_w[mask] = torch.from_numpy(tok["token_sq"].to_numpy(np.float64, copy=True)).to(dev)
    rewards = batch.rewards.to(dev).double()
    common = {"logprobs": batch.logprobs.to(dev).double(),
              "sum_pi_sq": batch.sum_pi_sq.to(dev).double()}
    b_proxy = otb_baseline(rewards, mask, **common)
    b_exact = otb_baseline(rewards, mask, token_weights=exact_w)
    a_proxy = advantages("otb", rewards, mask, **common)
    a_exact = advantages("otb", rewards, mask, token_weights=exact_w)
    dB = (b_proxy - b_exact)[mask].abs()
    dA = (a_proxy - a_exact)[mask].abs()
    scale = a_exact[mask].abs().mean().clamp(min=1e-12)
    vals = torch.stack([dB.mean(), dB.max(), dA.mean(), dA.mean() / scale,
                        (dA > 0.01 * scale).double().mean(), scale,
                        mask.sum().double()]).tolist()  # one host read
    return pd.DataFrame([{
        "state": state,
        "mean_abs_dB": vals[0],
        "max_abs_dB": vals[1],
        "mean_abs_dA": vals[2],
        "rel_dA": vals[3],
        "frac_tokens_dA_gt_1pct": vals[4],
        "mean_abs_A_exact": vals[5],
        "n_tokens": int(vals[6]),
    }])


@dataclass(frozen=True)
class ProxyConfig(Config):
    """The proxy-vs-true analysis (:func:`run`); defaults: 8 prompts x G = 8 per state."""

    n_prompts: int = knob(8, flags=("--prompts",))
    """Train prompts sampled per policy state (seeded)."""
    G: int = knob(8, flags=("-G",))
    """Responses per prompt."""
    reward: str | None = text(None)
    """Task reward (None: the task's first)."""
    seed: int = knob(0)
    """Seed of the prompts, the samples and the bootstrap."""
    n_boot: int = knob(200, flags=("--boot",))
    """Bootstrap draws of the correlation intervals (resampling sequences)."""
    n_bins: int = knob(10)
    """Quantile bins of the calibration table."""
    rollouts: str | None = text(None)
    """Responses sampled elsewhere from this checkpoint (.jsonl / .parquet,
    varbench.rollout.external) instead of sampling: the file's first n_prompts prompts x their
    first G responses."""
    logprob_tol: float | str = knob("auto", auto=True)
    """Largest mean |behaviour - recomputed| log-prob per token of a rollouts file (auto: by
    the model's dtype, varbench.rollout.external.default_logprob_tol)."""

    def check_together(self) -> None:
        """A rollouts file exists and has the needed columns (before any model is built)."""
        if self.rollouts is not None:
            check_columns(self.rollouts)


def plan(tasks: Sequence[Task], config: ProxyConfig, vocab_size=None) -> Plan:
    """What :func:`run` spends per policy state: ``n_prompts x G`` responses, each one
    forward+backward pass of the exact per-token norms."""
    n = config.n_prompts * config.G
    return Plan("proxy", n, passes=n, details=(f"{config.n_prompts} prompts x G = {config.G}",
                                               *rollouts_note(config.rollouts)))


def run(policies: Mapping[str, Policy], tasks: Sequence[Task], config: ProxyConfig, *,
        cache_dir: str | None = None, progress: bool | None = None,
        settings: dict[str, Any] | None = None) -> list[AnalysisResult]:
    """The proxy-vs-true analysis of every named policy state on the one task; one result
    with the states side by side (records ``tokens``, ``correlations``, ``calibration``,
    ``otb_baseline``). ``settings``: what else identifies the run (cache keys, provenance)."""
    if not isinstance(config, ProxyConfig):
        raise UsageError(f"config={config!r} is not valid; expected a ProxyConfig")
    task = one_task(tasks, "proxy")
    if not policies:
        raise UsageError("policies is empty; pass a Policy or a {state: Policy} mapping")
    c = config
    t0 = time.perf_counter()
    cfg = {"analysis": "proxy", "task": task.name, "knobs": task.knobs, "n_prompts": c.n_prompts,
           "G": c.G, "reward": task.check_reward(c.reward), "seed": c.seed, "n_boot": c.n_boot,
           "n_bins": c.n_bins, "states": list(policies),
           **rollouts_key(c.rollouts, c.logprob_tol), **(settings or {})}
    seed, reward = c.seed, c.reward
    cache = CellCache(cache_dir, cfg, placement=placement_of(policies))
    prompts = task.prompts(c.n_prompts, seed=seed)
    kinds = ("tokens", "correlations", "calibration", "otb_baseline")
    recs: dict[str, list[pd.DataFrame]] = {k: [] for k in kinds}
    for state, pol in policies.items():
        cells = {k: cache.load(f"{state}__{k}") for k in recs}
        # Under torchrun every rank must take the same branch (token_records gathers).
        if any(gather_objects(any(v is None for v in cells.values()))):
            batch = (sample(pol, task, prompts, c.G, seed=seed, reward=reward)
                     if c.rollouts is None else
                     rollout_batch(c.rollouts, pol, task, c.n_prompts, c.G, seed=seed,
                                   reward=reward, logprob_tol=c.logprob_tol, what="proxy"))
            tok = token_records(pol, batch, state=state, progress=show_progress(progress))
            cells = {
                "tokens": tok,
                "correlations": correlation_records(tok, n_boot=c.n_boot, seed=seed),
                "calibration": calibration_records(tok, n_bins=c.n_bins),
                "otb_baseline": otb_baseline_records(batch, tok, state=state),
            }
            for k, v in cells.items():
                cache.save(f"{state}__{k}", v)
        for k, v in cells.items():
            recs[k].append(v)
    records = {k: concat(v) for k, v in recs.items()}
    heads, notes = _headlines(records)
    wall = time.perf_counter() - t0
    device = str(next(iter(policies.values())).device)
    return [AnalysisResult(
        kind="proxy", name="proxy", records=records,
        summary={h.key: {"value": h.value, "se": h.se} for h in heads},
        headlines=heads, config=cfg, notes=notes,
        provenance=provenance(config=cfg, seeds={"prompts": seed, "sample": seed,
                                                 "bootstrap": seed},
                              device=device, wall_time_s=wall),
    )]


def proxy_correlation(
    policies: Policy | Mapping[str, Policy],
    task: Task,
    *,
    cache_dir: str | None = None,
    progress: bool | None = None,
    config: dict[str, Any] | None = None,
    **knobs: Any,
) -> AnalysisResult:
    """Run the proxy-vs-true analysis for each named policy state; records side by side.

    ``policies``: one Policy or ``{state name: Policy}`` (e.g. random init and warm-started);
    ``knobs``: :class:`ProxyConfig` fields (``n_prompts``, ``G``, ``reward``, ``seed``,
    ``n_boot``, ``n_bins``). Samples ``n_prompts`` train prompts x ``G`` responses per state
    (seeded). Returns an AnalysisResult with records ``tokens``, ``correlations``,
    ``calibration``, ``otb_baseline``. Caveat: at random init pi is near uniform and w_t nearly
    constant, so per-token correlations there are not meaningful; read the warm-started state.
    A thin wrapper of :func:`run`.
    """
    cfg = ProxyConfig(**knobs)
    if isinstance(policies, Policy):
        policies = {policies.name: policies}
    return run(dict(policies), [task], cfg, cache_dir=cache_dir, progress=progress,
               settings=config)[0]


def _headlines(records: dict[str, pd.DataFrame]) -> tuple[list[Headline], list[str]]:
    cor, otb = records["correlations"], records["otb_baseline"]
    heads: list[Headline] = []
    notes = [
        "Confidence intervals are 95% percentile bootstrap intervals resampling sequences.",
        "Pooled correlations of cumulative quantities (W_t vs prefix norms) are inflated by "
        "position alone (both grow with t); the within-position rows are the fair comparison.",
    ]
    for state in dict.fromkeys(cor["state"]):
        c = cor[cor["state"] == state]

        def pick(q, scope, method, c=c):
            r = c[(c["quantity"] == q) & (c["scope"] == scope) & (c["method"] == method)]
            return r.iloc[0] if len(r) else None

        for q, method in (("w_t vs token_sq", "spearman"), ("w_t vs token_sq", "pearson_log"),
                          ("W_T vs sequence_sq", "spearman")):
            r = pick(q, "sequence" if q.startswith("W_T") else "pooled", method)
            if r is not None:
                heads.append(Headline(
                    f"{state}:{q}:{method}", float(r["estimate"]), float(r["se"]),
                    correlation_sentence(f"{state}, {q}", method, r["estimate"], r["ci_low"],
                                         r["ci_high"], int(r["n_seq"])),
                    ci_lo=r["ci_low"], ci_hi=r["ci_high"], level=0.95))
        pooled = pick("W_t vs prefix_sq", "pooled", "spearman")
        within = c[(c["quantity"] == "W_t vs prefix_sq") & (c["scope"] == "position")
                   & (c["method"] == "spearman")]
        if pooled is not None and len(within):
            notes.append(
                f"{state}: pooled Spearman(W_t, prefix_sq) = {fmt(pooled['estimate'])} against "
                f"{fmt(within['estimate'].mean())} averaged within {len(within)} fixed positions."
            )
    notes.append(
        "OTB's weights enter its baseline linearly (B_t = sum_i W_t^i G_t^i / sum_i W_t^i), so "
        "OTB depends on the proxy's magnitudes (a log-log slope near 1, a high raw Pearson, the "
        "same concentration of the total in the top tokens), not only on its ranks (Spearman)."
    )
    for state in dict.fromkeys(cor["state"]):
        c = cor[(cor["state"] == state) & (cor["scope"] == "magnitude")].set_index("method")
        p = cor[(cor["state"] == state) & (cor["scope"] == "pooled")
                & (cor["quantity"] == "w_t vs token_sq") & (cor["method"] == "pearson")]
        if "loglog_slope" not in c.index or not len(p):
            continue
        s, pr = c.loc["loglog_slope"], p.iloc[0]
        t5 = c.loc["top5_share_y"] if "top5_share_y" in c.index else None
        t5x = c.loc["top5_share_x"] if "top5_share_x" in c.index else None
        heads.append(Headline(
            f"{state}:w_t vs token_sq:loglog_slope", float(s["estimate"]), float(s["se"]),
            f"{state}, magnitudes of w_t vs token_sq: log-log slope {fmt(s['estimate'])} "
            f"[95% CI {fmt(s['ci_low'])}, {fmt(s['ci_high'])}] (1 = proportional), Pearson "
            f"{fmt(pr['estimate'])} [95% CI {fmt(pr['ci_low'])}, {fmt(pr['ci_high'])}]; the "
            f"top 5% of tokens hold "
            f"{fmt(100 * float(t5['estimate']) if t5 is not None else None)}% of the exact "
            f"norm total against {fmt(100 * float(t5x['estimate']) if t5x is not None else None)}"
            f"% of the proxy total.", ci_lo=s["ci_low"], ci_hi=s["ci_high"], level=0.95))
    for r in otb.itertuples():
        heads.append(Headline(
            f"{r.state}:otb_mean_abs_dA", r.mean_abs_dA, None,
            f"{r.state}: OTB with proxy weights changes advantages by {fmt(r.mean_abs_dA)} on "
            f"average ({fmt(100 * r.rel_dA)}% of mean |A|; {fmt(100 * r.frac_tokens_dA_gt_1pct)}% "
            f"of tokens move by more than 1% of it); mean |B_proxy - B_exact| = "
            f"{fmt(r.mean_abs_dB)}."))
    return heads, notes



KIND = register_analysis(AnalysisKind(
    "proxy", ProxyConfig, run, proxy_figures, plan,
    "proxy w_t / W_t against exact per-token and prefix gradient norms",
    policies="states", tasks=("sort",), states=("random", "warm"),
    cli_defaults={"n_prompts": 4, "G": 6},
    description="Correlate the Logit-Gradient Proxy with exact per-token, prefix and sequence "
                "gradient norms at random init and warm-started, side by side."))
