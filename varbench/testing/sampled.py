"""The bias test of :mod:`varbench.testing.bias` on a real policy and task, against a sampled
reference gradient (``varbench check --policy P --task T``).

Per prompt, ``M x G`` responses are sampled and each response's per-token gradient vectors
taken once (:func:`~varbench.grads.vectors.token_vectors`, count-sketched to ``sketch_dim``;
the sketch is linear, so biases and means carry over to its space). Group m of prompt p is
responses ``m*G .. m*G+G-1``; an estimator's advantages ``A [M, G, T]`` give the group's
ascent estimate ``g_hat = 1/G sum_{i,t} A_{i,t} v_{i,t}`` (seq-mean-token-sum, ratio 1, as in
the toy test), averaged over the prompts: step m holds one group per prompt. The reference is
an independent sample of ``n_ref`` responses per prompt, ``g* = mean_n R_n sum_t v_{n,t}``
(the raw estimator: unbiased for ``grad E[R]``).

Unlike the toy test's exact ``g*``, this reference has its own noise; the tests account for it:
under H0 the difference of the means has covariance ``S_x / M + S_r / N`` (the two samples are
independent) and the Satterthwaite chi-square uses its traces. The rescaled test projects both
samples off the reference's direction and adds the reference's noise along the rest, scaled by
the estimator's scale along g* (first order in the reference's error).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from scipy import stats as sps

from varbench.stats.estimates import variance_stats


def sampled_estimates(policy: Any, task: Any, calls: dict[str, Callable], *, G: int, M: int,
                      n_prompts: int, n_ref: int, seed: int, reward: str | None = None,
                      sketch_dim: int | None = 256, progress: bool = False,
                      ) -> tuple[dict[str, torch.Tensor | str], torch.Tensor, float]:
    """``({name: estimates [M, K] or the error text}, reference rows [n_ref, K], tokens per
    step)`` for every estimator in ``calls`` on the same sampled groups (paired design)."""
    from varbench.grads.vectors import combine, token_vectors
    from varbench.rollout.sampler import sample

    prompts = task.prompts(n_prompts, seed=seed)
    est: dict[str, list[torch.Tensor] | str] = {name: [] for name in calls}
    refs, tokens = [], 0.0
    vec_kw = {"sketch_dim": sketch_dim, "sketch_seed": seed, "progress": progress}
    for p, prompt in enumerate(prompts):
        b = sample(policy, task, [prompt], M * G, seed=seed + 1000 * p, reward=reward)
        vec = token_vectors(policy.model, b, **vec_kw).vec.double().cpu()
        T = vec.shape[2]
        vec = vec.reshape(M, G, T, -1)
        mask = b.mask.cpu().reshape(M, G, T).float()
        tokens += float(mask.sum()) / M
        stats = {"logprobs": b.logprobs.cpu().reshape(M, G, T).float(),
                 "sum_pi_sq": b.sum_pi_sq.cpu().reshape(M, G, T).float()}
        rewards = b.rewards.cpu().reshape(M, G).float()
        for name, call in calls.items():
            if isinstance(est[name], str):
                continue
            try:
                adv = call(rewards, mask, **stats)
                if not isinstance(adv, torch.Tensor) or list(adv.shape) != [M, G, T]:
                    raise ValueError(f"estimator returned {getattr(adv, 'shape', type(adv))}, "
                                     f"expected {[M, G, T]}")
                adv = adv.detach().double()
                if not bool(torch.isfinite(adv).all()):
                    raise ValueError("estimator returned non-finite advantages")
            except Exception as err:  # the estimator under test may raise anything
                est[name] = f"{type(err).__name__}: {err}"
                continue
            est[name].append(combine(vec, adv * mask.double() / G))  # [M, K]
        r = sample(policy, task, [prompt], n_ref, seed=seed + 1000 * p + 7919, reward=reward)
        rv = token_vectors(policy.model, r, **vec_kw).vec.double().cpu()[0]  # [N, T, K]
        refs.append(r.rewards.cpu().double()[0, :, None] * rv.sum(1))  # [N, K]: R_n sum_t v
    out = {name: (e if isinstance(e, str) else torch.stack(e).mean(0)) for name, e in est.items()}
    return out, torch.stack(refs).mean(0), tokens


def _traces(rows: list[tuple[torch.Tensor, int]]) -> tuple[float, float]:
    """``(tr S, tr S^2)`` of ``S = sum_j Cov(x_j) / n_j`` for samples ``x_j [n_j, K]``."""
    covs = []
    for x, n in rows:
        xc = x - x.mean(0)
        covs.append(xc.T @ xc / (n - 1) / n)
    S = sum(covs)
    return float(S.trace()), float((S * S).sum())


def difference_pvalue(diff: torch.Tensor, rows: list[tuple[torch.Tensor, int]]) -> float:
    """p-value of H0 ``E diff = 0`` for a mean difference ``diff [K]`` whose covariance is
    ``sum_j Cov(x_j) / n_j`` (independent samples ``rows``; Satterthwaite chi-square)."""
    tr, tr2 = _traces(rows)
    stat = float(diff.pow(2).sum())
    if tr <= 0:
        return 0.0 if stat > 0 else 1.0
    a, nu = tr2 / tr, tr * tr / tr2
    return float(sps.chi2.sf(stat / a, nu))


def sampled_bias_rows(x: torch.Tensor, r: torch.Tensor, *, alpha: float, tolerance: float
                      ) -> list[dict]:
    """The raw and rescaled bias rows and the scale along g* of estimates ``x [M, K]`` against
    a sampled reference of rows ``r [N, K]`` (g* = their mean), each test at false-alarm rate
    ``alpha`` with the reference's noise in its null distribution."""
    M, N = x.shape[0], r.shape[0]
    g = r.mean(0)
    gnorm = float(g.norm())
    diff = x.mean(0) - g
    tr, _ = _traces([(x, M), (r, N)])
    raw = float(diff.norm()) / gnorm
    raw_deb = math.sqrt(max(float(diff.pow(2).sum()) - tr, 0.0)) / gnorm
    p_raw = difference_pvalue(diff, [(x, M), (r, N)])
    u = g / gnorm
    along = x @ u
    # ||g*||^2 debiased for the reference's noise (E ||r_bar||^2 = ||g||^2 + tr Cov(r) / N):
    # the scale on the noisy norm would shrink towards 0 and understate the noise below
    tr_r, _ = _traces([(r, N)])
    g2 = gnorm ** 2 - tr_r if gnorm ** 2 > tr_r else gnorm ** 2
    scale = float(along.mean()) * gnorm / g2
    scale_se = float(along.std() / math.sqrt(M)) * gnorm / g2
    perp = x - along.unsqueeze(-1) * u
    r_perp = scale * (r - (r @ u).unsqueeze(-1) * u)  # the reference's direction noise
    gbar_norm = float(x.mean(0).norm())
    pbar = perp.mean(0)
    tr_p, _ = _traces([(perp, M), (r_perp, N)])
    resc = float(pbar.norm()) / gbar_norm if gbar_norm else float("nan")
    resc_deb = (math.sqrt(max(float(pbar.pow(2).sum()) - tr_p, 0.0)) / gbar_norm
                if gbar_norm else float("nan"))
    p_resc = difference_pvalue(pbar, [(perp, M), (r_perp, N)])
    raw_se = variance_stats(x, g)["bias"][1] / gnorm
    return [
        {"check": "bias (raw)", "value": raw, "se": raw_se, "debiased": raw_deb,
         "p_value": p_raw, "threshold": tolerance,
         "passed": not (p_raw < alpha and raw_deb > tolerance),
         "detail": f"||E g_hat - g*|| / ||g*||, g* sampled ({N} responses per prompt)"},
        {"check": "bias (rescaled)", "value": resc, "se": None, "debiased": resc_deb,
         "p_value": p_resc, "threshold": tolerance,
         "passed": scale > 0 and not (p_resc < alpha and resc_deb > tolerance),
         "detail": "min_c>0 ||c E g_hat - g*|| / ||g*|| (sin of the angle), g* sampled"},
        {"check": "scale along g*", "value": scale, "se": scale_se, "debiased": None,
         "p_value": None, "threshold": None, "passed": scale > 0,
         "detail": "E[g_hat].g* / ||g*||^2 (1 = unbiased scale; centered: (G-1)/G)"},
    ]
