"""Bias and variance of an estimator's policy gradient against the exact gradient of a toy task.

On a :class:`~varbench.testing.toy.ToyPolicy` (enumerable, so ``g*`` is exact) we draw M
independent steps; each step samples a group of G responses for each of P prompts, asks the
estimator for ``A [P, G, T]`` and forms ``g_hat = 1/(P G) sum_{p,i,t} A_{p,i,t} g_{p,i,t}``
(seq-mean-token-sum aggregation: a constant weight, so only the advantage is on trial and an
unbiased advantage gives ``E g_hat = g*`` exactly).

Bias tests (each at false-alarm rate ``alpha`` for an estimator that has no such bias):

- raw: H0 ``E g_hat = g*``; statistic ``M ||g_bar - g*||^2``, which under H0 is a weighted sum
  of chi-square(1) variables with the eigenvalues of Cov(g_hat) as weights, approximated by the
  scaled chi-square ``a chi2_nu`` with matched mean and variance (Satterthwaite:
  ``a = tr S^2 / tr S``, ``nu = (tr S)^2 / tr S^2``).
- rescaled: H0 ``E g_hat = s g*`` for some ``s > 0``; the same test on the component of
  ``g_hat`` orthogonal to ``g*``. The reported value is the relative bias after the best positive
  rescaling, ``min_c ||c g_bar - g*|| / ||g*|| = sin angle(g_bar, g*)``.

A test fails only when the bias is significant (p < alpha) *and* its debiased size exceeds
``tolerance`` (relative to ``||g*||``): a bias too small to matter is reported, not flagged.
Caveats: the chi-square approximation is asymptotic in M; SEs are delete-one jackknife over
steps (from :mod:`varbench.stats.estimates`) and, for the rescaled value, ignore the noise of
the normaliser ``||g_bar||``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from scipy import stats as sps

from varbench.stats.estimates import paired_compare, variance_stats
from varbench.testing.toy import ToyPolicy


@dataclass
class Draws:
    """M steps of sampled groups on the toy task, shared by every estimator (paired design)."""

    prompt: torch.Tensor  # [M, P, G]
    tokens: torch.Tensor  # [M, P, G, T] (-1 pad)
    mask: torch.Tensor  # [M, P, G, T] float32
    rewards: torch.Tensor  # [M, P, G] float32
    logprobs: torch.Tensor  # [M, P, G, T] float32, 0 off the mask
    sum_pi_sq: torch.Tensor  # [M, P, G, T] float32, 0 off the mask


def draw(policy: ToyPolicy, M: int, G: int, seed: int) -> Draws:
    """Sample M steps of P groups of G responses with one seeded generator."""
    P = policy.task.num_prompts
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.arange(P).view(1, P, 1).expand(M, P, G).contiguous()
    tokens, mask = policy.sample(prompt, gen)
    logp, spsq = policy.token_stats(prompt, tokens, mask)
    rewards = policy.rewards(prompt, tokens, mask)
    return Draws(prompt, tokens, mask.float(), rewards.float(), logp.float(), spsq.float())


def estimates(
    policy: ToyPolicy, d: Draws, call: Callable, *, groups_per_call: int = 256
) -> torch.Tensor:
    """Group gradient estimates [M, D] of ``call`` (batches of ``groups_per_call`` groups).

    Raises whatever the estimator raises; a non-finite or wrongly shaped output is a ValueError.
    """
    M, P, G, T = d.mask.shape
    flat = {k: getattr(d, k).reshape(M * P, G, *getattr(d, k).shape[3:])
            for k in ("rewards", "mask", "logprobs", "sum_pi_sq")}
    step = max(P, groups_per_call - groups_per_call % P)  # keep a step's prompts together
    outs = []
    for s in range(0, M * P, step):
        part = {k: v[s : s + step] for k, v in flat.items()}
        out = call(part["rewards"], part["mask"], logprobs=part["logprobs"],
                   sum_pi_sq=part["sum_pi_sq"])
        if not isinstance(out, torch.Tensor) or list(out.shape) != list(part["mask"].shape):
            raise ValueError(f"estimator returned {getattr(out, 'shape', type(out))} on the "
                             f"toy task, expected {list(part['mask'].shape)}")
        outs.append(out.detach().to(torch.float64))
    adv = torch.cat(outs).reshape(M, P, G, T)
    if not bool(torch.isfinite(adv).all()):
        raise ValueError("estimator returned non-finite advantages on the toy task")
    coeff = adv * d.mask.double() / (P * G)
    return policy.scatter_scores(d.prompt.reshape(M, -1), d.tokens.reshape(M, P * G, T),
                                 coeff.reshape(M, P * G, T))


CHUNK_STEPS = 500  # steps drawn per seeded chunk (the unit of work a rank takes)


def chunked_estimates(
    policy: ToyPolicy, calls: dict[str, Callable], M: int, G: int, seed: int,
    *, groups_per_call: int = 256,
) -> tuple[dict[str, torch.Tensor | str], float]:
    """Estimates [M, D] of each named estimator on the same M steps, and tokens per step.

    Steps come in chunks of ``CHUNK_STEPS``, chunk c drawn with its own generator seeded from
    (seed, c), so the numbers do not depend on who computes a chunk. Data-parallel: when
    ``torch.distributed`` is initialised (e.g. under ``torchrun``), rank r computes chunks
    r, r + W, ... and ``all_gather_object`` hands every rank all chunks in order: the result
    equals the single-process one exactly. An estimator that raises gives the error text
    (``"Type: message"``) in place of its tensor, on every rank alike (no rank is left waiting
    in a collective).
    """
    from varbench._util.distributed import gather_objects, rank_world

    n_chunks = -(-M // CHUNK_STEPS)
    rank, world = rank_world()  # (0, 1) in one process and inside distributed.solo()
    local: dict[int, tuple[dict[str, torch.Tensor | str], float]] = {}
    for c in range(rank, n_chunks, world):
        n = min(CHUNK_STEPS, M - c * CHUNK_STEPS)
        d = draw(policy, n, G, seed * 1_000_003 + c)
        out: dict[str, torch.Tensor | str] = {}
        for name, call in calls.items():
            try:
                out[name] = estimates(policy, d, call, groups_per_call=groups_per_call)
            except Exception as err:  # the estimator under test may raise anything
                out[name] = f"{type(err).__name__}: {err}"
        local[c] = (out, float(d.mask.sum()))
    if world > 1:
        local = {c: v for part in gather_objects(local) for c, v in part.items()}
    chunks = [local[c] for c in range(n_chunks)]
    result: dict[str, torch.Tensor | str] = {}
    for name in calls:
        pieces = [ch[0][name] for ch in chunks]
        errors = [p for p in pieces if isinstance(p, str)]
        result[name] = errors[0] if errors else torch.cat(pieces)
    return result, sum(ch[1] for ch in chunks) / M


def mean_zero_pvalue(x: torch.Tensor) -> float:
    """p-value of H0 ``E x = 0`` from M rows of x [M, D] (Satterthwaite chi-square, see above)."""
    x = x.double()
    M = x.shape[0]
    xc = x - x.mean(0)
    cov = xc.T @ xc / (M - 1) if x.shape[1] <= M else None
    if cov is None:  # D > M: traces from the M x M Gram matrix instead
        gram = xc @ xc.T / (M - 1)
        tr, tr2 = float(gram.trace()), float((gram * gram).sum())
    else:
        tr, tr2 = float(cov.trace()), float((cov * cov).sum())
    stat = M * float(x.mean(0).pow(2).sum())
    if tr <= 0:
        return 0.0 if stat > 0 else 1.0
    a, nu = tr2 / tr, tr * tr / tr2
    return float(sps.chi2.sf(stat / a, nu))


def bias_rows(
    x: torch.Tensor, g_star: torch.Tensor, *, alpha: float, tolerance: float
) -> list[dict]:
    """Rows for the raw and the rescaled bias test of estimates x [M, D] against g* [D]."""
    M = x.shape[0]
    gnorm = float(g_star.norm())
    vs = variance_stats(x, g_star)
    raw = vs["bias"][0] / gnorm
    raw_deb = math.sqrt(max(vs["bias2_debiased"][0], 0.0)) / gnorm
    p_raw = mean_zero_pvalue(x - g_star)
    u = g_star / gnorm
    along = x @ u  # [M]
    scale = float(along.mean()) / gnorm  # E g_hat . g* / ||g*||^2
    scale_se = float(along.std() / math.sqrt(M)) / gnorm
    perp = x - along.unsqueeze(-1) * u
    vp = variance_stats(perp, torch.zeros_like(g_star))
    gbar_norm = float(x.mean(0).norm())
    resc = vp["bias"][0] / gbar_norm
    resc_deb = math.sqrt(max(vp["bias2_debiased"][0], 0.0)) / gbar_norm
    p_resc = mean_zero_pvalue(perp)
    return [
        {
            "check": "bias (raw)", "value": raw, "se": vs["bias"][1] / gnorm,
            "debiased": raw_deb, "p_value": p_raw, "threshold": tolerance,
            "passed": not (p_raw < alpha and raw_deb > tolerance),
            "detail": "||E g_hat - g*|| / ||g*||",
        },
        {
            "check": "bias (rescaled)", "value": resc, "se": vp["bias"][1] / gbar_norm,
            "debiased": resc_deb, "p_value": p_resc, "threshold": tolerance,
            "passed": scale > 0 and not (p_resc < alpha and resc_deb > tolerance),
            "detail": "min_c>0 ||c E g_hat - g*|| / ||g*|| (sin of the angle)",
        },
        {
            "check": "scale along g*", "value": scale, "se": scale_se, "debiased": None,
            "p_value": None, "threshold": None, "passed": scale > 0,
            "detail": "E[g_hat].g* / ||g*||^2 (1 = unbiased scale; centered: (G-1)/G)",
        },
    ]


def variance_rows(
    x: torch.Tensor, baselines: dict[str, torch.Tensor], g_star: torch.Tensor, tokens: float,
    *, max_ratio: float | None,
) -> list[dict]:
    """Variance at equal token budget (same sampled groups, so the same tokens) against each
    baseline, every estimate first rescaled by its best positive factor onto g* so that a
    shrunken advantage does not pass for a low-variance one."""

    def rescaled(e: torch.Tensor) -> torch.Tensor:
        gbar = e.mean(0)
        c = float(gbar @ g_star) / max(float(gbar @ gbar), 1e-300)
        return e * c

    tok = torch.full((x.shape[0],), tokens, dtype=torch.float64)
    xs = rescaled(x)
    own = variance_stats(xs, g_star, tokens=tok)
    rows = [{
        "check": "variance x tokens", "value": own["variance_x_tokens"][0],
        "se": own["variance_x_tokens"][1], "debiased": None, "p_value": None,
        "threshold": None, "passed": True,
        "detail": f"tr Cov(c g_hat) x {tokens:.1f} tokens per step (after rescaling c)",
    }]
    for name, e in baselines.items():
        cmp = paired_compare(xs, rescaled(e), g_star, stat="variance_x_tokens",
                             tokens_a=tok, tokens_b=tok)
        ok = max_ratio is None or cmp["ratio"] <= max_ratio
        rows.append({
            "check": f"variance ratio vs {name}", "value": cmp["ratio"], "se": cmp["ratio_se"],
            "debiased": None, "p_value": None, "threshold": max_ratio, "passed": ok,
            "detail": "paired, same groups and tokens; < 1 means lower variance",
        })
    return rows
