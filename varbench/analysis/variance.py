"""Estimator variance (docs/science.md section 5): variance, bias, MSE, cosine, SNR per scheme x G.

    res = estimator_variance(policy, get_task("sort"), Gs=(2, 4, 8))
    res.records["cells"]    # scheme, G, mode, variance, variance_se, bias, ..., per prompt mean

For each prompt, ``M * max(Gs)`` responses are sampled once; group m of size G is responses
``m*G .. m*G+G-1``. Per-token gradient vectors (exact harness, count-sketched) are computed once
per response and every (scheme, G, mode) estimate ``g_hat_m = sum_{i,t} c_{i,t} v_{i,t}`` is a
contraction of them, with ``c`` the exact loss coefficient at ratio 1 (``token_coefficients``,
sign flipped to the ascent direction). Schemes therefore share their sampled groups: differences
between schemes are paired, and their jackknife SEs (``paired`` records) are small.

Reference g*: ``exact`` enumerates the whole response space (fixed-length tasks with small V**T;
``varbench.analysis.oracle``) and computes g* through the same vectors; ``sampled`` uses an
independent sample with the unbiased raw estimator (its SE reported). Both are the gradient of
J = E[R] (seq-mean-token-sum scale); other modes compare against g* scaled by their constant
(1/L for seq-mean-token-sum-norm; 1/E|o| for token-mean and seq-mean-token-mean, exact only for
fixed-length tasks: for variable lengths these modes estimate a length-weighted objective).

Data-parallel (``torch.distributed``): when a process group is joined (e.g. by
``varbench._util.distributed.init_from_env`` under ``torchrun``), prompt ``p`` is computed by
rank ``p % world_size`` only; its sampling seed depends on the global index ``p`` alone, so the
per-prompt cells do not depend on the world size. The per-prompt records are then exchanged with
``all_gather_object`` and every rank pools the same records, equal to a one-process run with the
same seed (to float tolerance: reductions on different thread counts may round differently).
The same code path runs gloo on CPU and NCCL on GPUs (one GPU per rank)::

    torchrun --standalone --nproc_per_node 2 -m varbench variance --prompts 4 ...
    # GPUs: same command on a machine with CUDA; init_from_env picks NCCL and LOCAL_RANK's GPU

See docs/distributed.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from varbench._util.checks import UsageError, check_choice, check_positive_int
from varbench._util.distributed import gather_objects, rank_world
from varbench._util.progress import show_progress
from varbench.analysis._common import CellCache, concat
from varbench.analysis.oracle import enumerate_distribution
from varbench.analysis.variance_report import variance_headlines
from varbench.estimators.aggregation import AGGREGATION_MODES
from varbench.estimators.coefficients import token_coefficients
from varbench.estimators.registry import advantages
from varbench.estimators.registry import schemes as registered_schemes
from varbench.grads.seqnorms import sequence_grad_norms
from varbench.grads.vectors import combine, token_vectors
from varbench.models.presets import Policy
from varbench.report.provenance import provenance
from varbench.report.result import AnalysisResult
from varbench.rollout.sampler import sample
from varbench.stats.estimates import VARIANCE_STATS, paired_compare, variance_stats
from varbench.tasks.base import Task

# Label -> registered scheme; labels ending in "_exact" use exact ||g_t||^2 as OTB weights,
# every other label gets the proxy inputs (logprobs, sum_pi_sq) that OTB-type schemes read.
DEFAULT_SCHEMES: tuple[str, ...] = (
    "raw", "centered", "normalized", "rloo", "topk", "otb", "otb_exact", "otb_loo",
)
DEFAULT_GS: tuple[int, ...] = (2, 4, 8, 16, 32)
_EXACT_LIMIT = 200_000  # largest V**T enumerated for an exact reference


def scheme_of(label: str) -> str:
    """Registered scheme behind a label (``otb_exact`` -> ``otb``)."""
    return label[: -len("_exact")] if label.endswith("_exact") else label


def group_advantages(label, rewards, mask, logprobs, sum_pi_sq, token_sq, *, k=1):
    """``[M, G, T]`` advantages of scheme ``label`` for M groups (one group per row)."""
    opts: dict[str, Any] = {"logprobs": logprobs, "sum_pi_sq": sum_pi_sq, "k": k}
    if label.endswith("_exact"):
        opts = {"token_weights": token_sq, "k": k}
    return advantages(scheme_of(label), rewards, mask, **opts)


def group_estimates(vec: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, logp: torch.Tensor,
                    mode: str, *, max_len: int) -> torch.Tensor:
    """``[M, K]`` ascent-direction estimates ``sum_{i,t} c_{i,t} v_{i,t}`` for each group.

    ``vec [M, G, T, K]``; ``adv``, ``mask``, ``logp`` ``[M, G, T]``. The coefficient is the exact
    per-token gradient weight of the clipped loss at ratio 1 (``token_coefficients``), computed
    per group so that each group is its own batch (B = G in the aggregation weights).
    """
    coef = torch.stack([
        -token_coefficients(logp[m : m + 1], logp[m : m + 1], adv[m : m + 1], mask[m : m + 1],
                            mode, max_len=max_len)[0]
        for m in range(adv.shape[0])
    ])
    # The one contraction (varbench.grads.vectors.combine): in the vectors' dtype, no
    # per-scheme copy of the large [M, G, T, K] tensor.
    return combine(vec, coef).to(torch.float64)


def _mode_scale(mode: str, mean_len: float, max_len: int) -> float:
    if mode == "seq-mean-token-sum":
        return 1.0
    if mode == "seq-mean-token-sum-norm":
        return 1.0 / max_len
    return 1.0 / mean_len


def _reference(policy, task, prompt, p_seed, *, kind, reward, n_ref, vec_kw, progress):
    """(g* [K], se_norm, description) in the sketch space of ``vec_kw``."""
    if kind == "exact":
        dist = enumerate_distribution(policy, task, prompt, reward=reward)
        batch, coef = dist.gradient_batch()
        if batch.tokens.shape[1] == 0:
            return None, 0.0, "exact (J = 0: every response scores 0)"
        tv = token_vectors(policy.model, batch, progress=progress, **vec_kw)
        g = combine(tv.vec.double(), coef.double())[0]  # one prompt: P = 1
        return g, 0.0, f"exact enumeration of {dist.responses.shape[0]} responses"
    batch = sample(policy, task, [prompt], n_ref, seed=p_seed + 7919, reward=reward)
    tv = token_vectors(policy.model, batch, progress=progress, **vec_kw)
    per = batch.rewards.double()[0, :, None] * tv.vec.double()[0].sum(1)  # [N, K] R_i sum_t v
    g = per.mean(0)
    se = float(((per - g) ** 2).sum() / (n_ref - 1) / n_ref) ** 0.5
    return g, se, f"sampled: raw estimator over {n_ref} independent responses"


def _cell(tv, batch, G, M, labels, modes, ref, *, topk_k, max_len, mean_len):
    """Statistics of every (scheme, mode) at group size G for one prompt; paired ratios."""
    n = M * G
    T = batch.T

    def grp(x):
        return x[0, :n].reshape(M, G, *x.shape[2:])

    vec, mask = grp(tv.vec), grp(batch.mask) != 0
    logp, spsq, tsq = grp(batch.logprobs), grp(batch.sum_pi_sq), grp(tv.token_sq)
    rewards = batch.rewards[0, :n].reshape(M, G).to(logp.dtype)
    tokens = mask.sum((1, 2)).double()
    agree = (rewards == rewards[:, :1]).all(1).double().mean()
    rows, paired, est = [], [], {}
    for label in labels:
        adv = group_advantages(label, rewards, mask, logp, spsq, tsq, k=topk_k)
        nonzero = ((adv != 0) & mask).any(-1).double().mean()
        for mode in modes:
            r = None if ref is None else ref * _mode_scale(mode, mean_len, max_len)
            e = group_estimates(vec, adv, mask.to(logp.dtype), logp, mode, max_len=max_len)
            est[label, mode] = (e, r)
            st = variance_stats(e, r, tokens=tokens)
            row = {"scheme": label, "G": G, "mode": mode, "M": M, "T": T}
            for k in VARIANCE_STATS:
                row[k], row[f"{k}_se"] = st[k]
            row["frac_nonzero_delta"] = float(nonzero)
            row["frac_all_agree"] = float(agree)
            row["tokens_per_group"] = float(tokens.mean())
            rows.append(row)
    for (label, mode), (e, r) in est.items():
        if ("centered", mode) not in est or label == "centered":
            continue
        for stat in ("variance", "mse"):
            if stat == "mse" and r is None:
                continue
            c = paired_compare(e, est["centered", mode][0], r, stat=stat)
            paired.append({"scheme": label, "baseline": "centered", "G": G, "mode": mode,
                           "stat": stat, "ratio": c["ratio"], "ratio_se": c["ratio_se"],
                           "diff": c["diff"], "diff_se": c["diff_se"]})
    return pd.DataFrame(rows), pd.DataFrame(paired)


def estimator_variance(
    policy: Policy,
    task: Task,
    *,
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    Gs: Sequence[int] = DEFAULT_GS,
    modes: Sequence[str] = ("seq-mean-token-sum",),
    M: int = 32,
    n_prompts: int = 2,
    reward: str | None = None,
    reference: str = "auto",
    n_ref: int = 2048,
    sketch_dim: int | None = 1024,
    topk_k: int = 1,
    seed: int = 0,
    cache_dir: str | None = None,
    progress: bool | None = None,
    config: dict[str, Any] | None = None,
) -> AnalysisResult:
    """Variance statistics per scheme x G x mode, averaged over ``n_prompts`` prompts.

    ``schemes``: labels (registered scheme names, or ``<scheme>_exact`` for OTB-type schemes
    with exact ||g_t||^2 weights). ``reference``: "exact", "sampled" or "auto" (exact when the
    task is fixed-length with V**T <= 200k). Records: ``cells`` (prompt means; SE =
    sqrt(sum se^2) / n_prompts over independent prompts), ``cells_by_prompt``, ``paired``
    (ratio to centered on the same groups), ``reference``. Finished (prompt, G) cells are cached
    under ``cache_dir`` and skipped on rerun.

    Under a joined ``torch.distributed`` process group, prompts are sharded over the ranks
    (prompt ``p`` on rank ``p % world_size``) and gathered; every rank returns the full result.
    The gather is a collective: every rank must make the same call.
    """
    known = set(registered_schemes())
    for s in schemes:
        check_choice("schemes", scheme_of(s), sorted(known))
    for G in Gs:
        check_positive_int("Gs", G, minimum=2)
    for mode in modes:
        check_choice("modes", mode, AGGREGATION_MODES)
    check_positive_int("M", M, minimum=3)
    check_positive_int("n_prompts", n_prompts)
    check_choice("reference", reference, ("auto", "exact", "sampled"))
    reward = task.check_reward(reward)
    V = int(policy.model.get_output_embeddings().weight.shape[0])
    enumerable = task.fixed_length and V**task.max_new_tokens <= _EXACT_LIMIT
    if reference == "exact" and not enumerable:
        raise UsageError(
            f"reference='exact' needs a fixed-length task with V**T <= {_EXACT_LIMIT}; task "
            f"{task.name!r} (V={V}, T={task.max_new_tokens}) is not; use reference='sampled'"
        )
    use_exact = reference == "exact" or (reference == "auto" and enumerable)
    ref_kind = "exact" if use_exact else "sampled"
    t0 = time.perf_counter()
    Gs = sorted(set(int(g) for g in Gs))
    cfg = {"analysis": "variance", "policy": policy.name, "policy_meta": policy.meta,
           "task": task.name, "knobs": task.knobs, "reward": reward, "schemes": list(schemes),
           "Gs": Gs, "modes": list(modes), "M": M, "n_prompts": n_prompts, "reference": ref_kind,
           "n_ref": n_ref, "sketch_dim": sketch_dim, "topk_k": topk_k, "seed": seed,
           **(config or {})}
    cache = CellCache(cache_dir, cfg)
    vec_kw = {"sketch_dim": sketch_dim, "sketch_seed": seed}
    prompts = task.prompts(n_prompts, seed=seed)
    show = show_progress(progress)
    max_len = task.max_new_tokens
    rank, world = rank_world()
    mine = [(p, prompt) for p, prompt in enumerate(prompts) if p % world == rank]
    cells, paired, refs = [], [], []
    bar = tqdm(total=len(mine) * len(Gs), desc="variance cells", disable=not show or rank != 0)
    for p, prompt in mine:
        names = [f"p{p}_G{G}" for G in Gs]
        done = [(cache.load(n + "_cells"), cache.load(n + "_paired")) for n in names]
        ref_row = cache.load(f"p{p}_reference")
        if ref_row is None or any(c is None or pr is None for c, pr in done):
            p_seed = seed + 1000 * p
            batch = sample(policy, task, [prompt], M * Gs[-1], seed=p_seed, reward=reward)
            tv = token_vectors(policy.model, batch, progress=show, **vec_kw)
            mean_len = float(batch.mask.sum(-1).double().mean())
            g_ref, ref_se, desc = _reference(policy, task, prompt, p_seed, kind=ref_kind,
                                             reward=reward, n_ref=n_ref, vec_kw=vec_kw,
                                             progress=show)
            ref_row = pd.DataFrame([{
                "prompt": p, "prompt_text": prompt.text, "reference": desc,
                "ref_norm": float(g_ref.norm()) if g_ref is not None else 0.0,
                "ref_se_norm": ref_se, "sketch": tv.sketch, "n_params": tv.n_params,
                "mean_len": mean_len, "mean_reward_sampled": float(batch.rewards.mean()),
                **_sequence_norms(policy.model, batch, tv),
            }])
            cache.save(f"p{p}_reference", ref_row)
            for i, G in enumerate(Gs):
                if done[i][0] is None or done[i][1] is None:
                    c, pr = _cell(tv, batch, G, M, schemes, modes, g_ref, topk_k=topk_k,
                                  max_len=max_len, mean_len=mean_len)
                    c.insert(0, "prompt", p)
                    pr.insert(0, "prompt", p)
                    cache.save(names[i] + "_cells", c)
                    cache.save(names[i] + "_paired", pr)
                    done[i] = (c, pr)
                bar.update(1)
        else:
            bar.update(len(Gs))
        refs.append(ref_row)
        cells += [c for c, _ in done]
        paired += [pr for _, pr in done]
    bar.close()
    if world > 1:
        cells, paired, refs = _gather_by_prompt(mine, len(Gs), cells, paired, refs)
    by_prompt, paired_df, ref_df = concat(cells), concat(paired), concat(refs)
    records = {"cells": _pool(by_prompt, ["scheme", "G", "mode"]),
               "paired": _pool(paired_df, ["scheme", "baseline", "G", "mode", "stat"]),
               "cells_by_prompt": by_prompt, "reference": ref_df}
    heads, notes, summary = variance_headlines(records, ref_kind)
    wall = time.perf_counter() - t0
    return AnalysisResult(
        kind="variance", name="variance", records=records, summary=summary, headlines=heads,
        config=cfg, notes=notes,
        provenance=provenance(config=cfg, seeds={"prompts": seed, "sample": "seed + 1000 * p",
                                                 "sketch": seed},
                              device=str(policy.device), wall_time_s=wall),
    )


def _sequence_norms(model, batch, tv) -> dict[str, float]:
    """Mean per-response ``||sum_t g_t||^2``: exact (one batched backward,
    :func:`varbench.grads.sequence_grad_norms`) and through the sketch of ``tv`` (its
    expectation over sketches is the exact value: a per-prompt check of the sketch)."""
    flat = batch.flat()
    exact = sequence_grad_norms(model, flat.input_ids, flat.response_mask, flat.attention_mask)
    sketched = tv.vec.sum(2).pow(2).sum(-1)  # [P, G]: ||S sum_t g_t||^2 (0 off the mask)
    return {"seq_sq_exact": float(exact.double().mean()),
            "seq_sq_sketched": float(sketched.double().mean())}


def _gather_by_prompt(mine, n_g, cells, paired, refs):
    """Every rank's per-prompt frames, back in global prompt order (one-process order)."""
    local = [(p, refs[i], cells[i * n_g : (i + 1) * n_g], paired[i * n_g : (i + 1) * n_g])
             for i, (p, _) in enumerate(mine)]
    merged = sorted((x for part in gather_objects(local) for x in part), key=lambda x: x[0])
    return ([c for x in merged for c in x[2]], [pr for x in merged for pr in x[3]],
            [x[1] for x in merged])


def _pool(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Mean over prompts of each value column; SE = sqrt(sum se^2) / n (independent prompts)."""
    if not len(df):
        return df
    vals = [c for c in df.columns if c not in keys + ["prompt"] and not c.endswith("_se")
            and pd.api.types.is_numeric_dtype(df[c])]
    g = df.groupby(keys, sort=False)
    out = g[vals].mean()
    for c in vals:
        if f"{c}_se" in df:
            out[f"{c}_se"] = g[f"{c}_se"].apply(lambda s: float((s**2).sum() ** 0.5) / len(s))
    out["n_prompts"] = g.size()
    return out.reset_index()
