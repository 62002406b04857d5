"""Slow, literal Python-loop references for varbench.estimators (float64 Python floats).

Each function follows docs/science.md word for word, one group / response / token at a time, with no
vectorisation and no shared code with the library, so an equivalence test compares two
independent readings of the formulas.
"""

from __future__ import annotations

import itertools
import math

import torch


def _lists(rewards, mask):
    m = (mask != 0).tolist()
    r = rewards.double().tolist()
    return r, m


def _returns(r_i, m_i):
    """Return R_i of one response: outcome float, or the sum of valid token rewards."""
    if isinstance(r_i, float):
        return r_i
    return sum(x for x, v in zip(r_i, m_i, strict=True) if v)


def _to_go(r_i, m_i):
    T = len(m_i)
    if isinstance(r_i, float):
        return [r_i if m_i[t] else 0.0 for t in range(T)]
    out = [0.0] * T
    for t in range(T):
        if m_i[t]:
            out[t] = sum(r_i[k] for k in range(t, T) if m_i[k])
    return out


def _mean(xs):
    return sum(xs) / len(xs)


def _group_adv(scheme, R, lengths, opts):
    """Per-response advantage of one group for the outcome schemes (list of G floats)."""
    G = len(R)
    mu = _mean(R)
    if scheme == "raw":
        return list(R)
    if scheme == "centered":
        return [x - mu for x in R]
    if scheme == "normalized":
        if G == 1:
            return list(R)
        ddof = 1 if opts.get("unbiased_std", True) else 0
        sigma = math.sqrt(sum((x - mu) ** 2 for x in R) / (G - ddof))
        return [(x - mu) / (sigma + opts.get("eps", 1e-6)) for x in R]
    if scheme == "rloo":
        if G == 1:
            return list(R)
        return [R[i] - sum(R[j] for j in range(G) if j != i) / (G - 1) for i in range(G)]
    if scheme == "topk":
        k = min(opts.get("k", 1), G)
        kth = sorted(R, reverse=True)[k - 1]
        return [(x - mu) if x >= kth else 0.0 for x in R]
    if scheme == "opo":
        tot = sum(lengths)
        b = sum(L * x for L, x in zip(lengths, R, strict=True)) / tot if tot else 0.0
        return [x - b for x in R]
    if scheme == "passk":
        k = opts.get("k", 1)
        n_fail = sum(1 for x in R if x == 0)
        rbar = 1 - math.comb(n_fail, k) / math.comb(G, k)
        sigma = math.sqrt(rbar * (1 - rbar))
        if sigma == 0:
            return [0.0] * G
        fail_hit = math.comb(n_fail - 1, k - 1) / math.comb(G - 1, k - 1) if n_fail else 0.0
        return [(1 - rbar) / sigma if x == 1 else (1 - rbar - fail_hit) / sigma for x in R]
    raise KeyError(scheme)


def passk_bruteforce(R, k):
    """pass@k advantages of one group by enumerating k-subsets (docs/science.md section 2.1)."""
    G = len(R)
    subsets = list(itertools.combinations(range(G), k))
    rbar = _mean([max(R[j] for j in s) for s in subsets])
    sigma = math.sqrt(rbar * (1 - rbar))
    if sigma == 0:
        return [0.0] * G
    out = []
    for i in range(G):
        mine = [max(R[j] for j in s) - rbar for s in subsets if i in s]
        out.append(_mean(mine) / sigma)
    return out


def _otb_weights(P, G, T, m, opts):
    """Cumulative W[p][i][t] (0 where masked), literal docs/science.md section 2.2."""
    if opts.get("cumulative_weights") is not None:
        cw = opts["cumulative_weights"].double().tolist()
        return [[[cw[p][i][t] if m[p][i][t] else 0.0 for t in range(T)] for i in range(G)]
                for p in range(P)]
    if opts.get("token_weights") is not None:
        w = opts["token_weights"].double().tolist()
    else:
        lp = opts["logprobs"].double().tolist()
        sp = opts["sum_pi_sq"].double().tolist()
        w = [[[1 - 2 * math.exp(lp[p][i][t]) + sp[p][i][t] for t in range(T)] for i in range(G)]
             for p in range(P)]
    rho = opts.get("importance_weights")
    rho = rho.double().tolist() if rho is not None else None
    W = [[[0.0] * T for _ in range(G)] for _ in range(P)]
    for p in range(P):
        for i in range(G):
            acc = 0.0
            for t in range(T):
                if m[p][i][t]:
                    wt = w[p][i][t] * (rho[p][i][t] ** 2 if rho is not None else 1.0)
                    acc += wt
                    W[p][i][t] = acc
    return W


def _otb_group(Gt, W, m, opts, loo):
    """OTB advantages of one group via explicit compaction to mask = 1 tokens, then scatter."""
    G, T = len(m), len(m[0])
    eps = opts.get("baseline_eps", 1e-8)
    compact = opts.get("compact", True)
    pos = []  # original positions of each response's compacted tokens
    for i in range(G):
        pos.append([t for t in range(T) if m[i][t]] if compact else list(range(T)))
    valid = [[m[i][t] for t in pos[i]] for i in range(G)]
    n = max(len(x) for x in pos)
    A = [[0.0] * T for _ in range(G)]
    for c in range(n):
        running = [i for i in range(G) if c < len(pos[i]) and valid[i][c]]
        for i in running:
            t = pos[i][c]
            others = [j for j in running if j != i] if loo else running
            if loo and not others:
                b = 0.0
            elif not loo and len(running) == 1 and opts.get("handle_zero_tail", True):
                b = 0.0
            else:
                num = sum(Gt[j][pos[j][c]] * W[j][pos[j][c]] for j in others)
                den = sum(W[j][pos[j][c]] for j in others)
                b = num / (den + eps)
            A[i][t] = Gt[i][t] - b
    return A


def ref_advantages(scheme, rewards, mask, **opts):
    """Loop reference of ``varbench.advantages`` -> float64 tensor [P, G, T]."""
    P, G, T = mask.shape
    r, m = _lists(rewards, mask)
    out = [[[0.0] * T for _ in range(G)] for _ in range(P)]
    if scheme in ("otb", "otb_loo"):
        W = _otb_weights(P, G, T, m, opts)
        for p in range(P):
            Gt = [_to_go(r[p][i], m[p][i]) for i in range(G)]
            out[p] = _otb_group(Gt, W[p], m[p], opts, loo=scheme == "otb_loo")
        return torch.tensor(out, dtype=torch.float64)
    per_resp = []
    for p in range(P):
        R = [_returns(r[p][i], m[p][i]) for i in range(G)]
        lengths = [sum(m[p][i]) for i in range(G)]
        base = "centered" if scheme == "reinforce_pp_baseline" else scheme
        per_resp.append(_group_adv(base, R, lengths, opts))
    if scheme == "reinforce_pp_baseline":
        vals = [per_resp[p][i] for p in range(P) for i in range(G) for t in range(T) if m[p][i][t]]
        mu = _mean(vals)
        var = sum((v - mu) ** 2 for v in vals) / max(len(vals) - 1, 1)
        scale = 1 / math.sqrt(var + opts.get("whiten_eps", 1e-8))
        per_resp = [[(a - mu) * scale for a in row] for row in per_resp]
    for p in range(P):
        for i in range(G):
            for t in range(T):
                if m[p][i][t]:
                    out[p][i][t] = per_resp[p][i]
    return torch.tensor(out, dtype=torch.float64)


def ref_aggregation_weights(mask, mode, max_len=None):
    """omega per docs/science.md section 3, one token at a time -> float64 tensor like mask."""
    P, G, T = mask.shape
    m = (mask != 0).tolist()
    B = P * G
    total = sum(v for g in m for row in g for v in row)
    out = [[[0.0] * T for _ in range(G)] for _ in range(P)]
    for p in range(P):
        for i in range(G):
            length = sum(m[p][i])
            for t in range(T):
                if not m[p][i][t]:
                    continue
                if mode == "token-mean":
                    out[p][i][t] = 1 / total
                elif mode == "seq-mean-token-mean":
                    out[p][i][t] = 1 / (B * length)
                elif mode == "seq-mean-token-sum":
                    out[p][i][t] = 1 / B
                else:
                    out[p][i][t] = 1 / (B * (max_len or T))
    return torch.tensor(out, dtype=torch.float64)


def ref_policy_loss(logp, logp_old, adv, mask, mode, clip=(0.2, 0.2), ratio="token",
                    max_len=None):
    """Loss value of policy_loss, summing per-token terms in Python floats."""
    P, G, T = mask.shape
    omega = ref_aggregation_weights(mask, mode, max_len).tolist()
    lp, lo_, a = logp.double().tolist(), logp_old.double().tolist(), adv.double().tolist()
    m = (mask != 0).tolist()
    total = 0.0
    for p in range(P):
        for i in range(G):
            valid = [t for t in range(T) if m[p][i][t]]
            s = math.exp(sum(lp[p][i][t] - lo_[p][i][t] for t in valid) / max(len(valid), 1))
            for t in valid:
                r = math.exp(lp[p][i][t] - lo_[p][i][t]) if ratio == "token" else s
                rc = min(max(r, 1 - clip[0]), 1 + clip[1])
                A = a[p][i][t]
                total += omega[p][i][t] * max(-A * r, -A * rc)
    return total


def ref_token_coefficients(logp, logp_old, adv, mask, mode, **kw):
    """Brute-force c = d policy_loss / d logp by autograd through the library loss."""
    from varbench.estimators import policy_loss

    x = logp.detach().clone().requires_grad_(True)
    loss, _ = policy_loss(x, logp_old, adv, mask, mode, **kw)
    (g,) = torch.autograd.grad(loss, x)
    return g
