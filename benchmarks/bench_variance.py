"""Variance analysis for 7 schemes sharing per-token gradients vs recomputing them per scheme.

    .venv/bin/python benchmarks/bench_variance.py [--preset tiny] [-M 6] [-G 4] [--repeat 3]

Sampling is done once, outside every timing. Contenders, side by side in one process:
- shared:   per-token gradient vectors once, then 7 schemes (advantages -> group estimates ->
            variance statistics) as contractions of the same vectors (what the analysis does);
- one:      the same pipeline for a single scheme (centered);
- separate: the pipeline run once per scheme, recomputing the vectors each time;
- backward: once per scheme, each group's estimate by one backward of its weighted log-prob
            sum (``varbench.grads.group_gradients``), no per-token vectors.
The shared path's flat (unsketched) estimates must equal ``group_gradients``' (checked before
timing); the timed vector routes use the analysis's count sketch (``--sketch-dim``, 1024).
Target: shared (7 schemes) <= 1.5 x one scheme.
Reports the median of ``--repeat`` runs, in process CPU seconds by default (``--clock cpu``,
one thread): on a machine shared with other jobs, wall time measures the neighbours.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from varbench.analysis.variance import group_advantages, group_estimates
from varbench.estimators.coefficients import token_coefficients
from varbench.grads.group import group_gradients
from varbench.grads.vectors import token_vectors
from varbench.models import build_preset
from varbench.rollout.sampler import sample
from varbench.stats.estimates import variance_stats
from varbench.tasks import get_task

SCHEMES = ("raw", "centered", "normalized", "rloo", "topk", "otb", "otb_loo")


def _grp(x, M, G):
    return x[0, : M * G].reshape(M, G, *x.shape[2:])


def run(policy, batch, labels, M, G, sketch_dim=None):
    """The analysis's variance pipeline for ``labels`` (per-token vectors computed once)."""
    tv = token_vectors(policy.model, batch, sketch_dim=sketch_dim)
    T = batch.T
    mask = _grp(batch.mask, M, G) != 0
    logp = _grp(batch.logprobs, M, G)
    rewards = batch.rewards[0, : M * G].reshape(M, G).to(logp.dtype)
    out = {}
    for label in labels:
        adv = group_advantages(label, rewards, mask, logp, _grp(batch.sum_pi_sq, M, G),
                               _grp(tv.token_sq, M, G))
        est = group_estimates(_grp(tv.vec, M, G), adv, mask.to(logp.dtype), logp,
                              "seq-mean-token-sum", max_len=T)
        out[label] = (est, variance_stats(est)["variance"])
    return out


def run_backward(policy, batch, labels, M, G):
    """Per scheme: coefficients, then one backward per group (``group_gradients``, flat)."""
    T = batch.T
    groups = dataclasses.replace(
        batch,
        prompt_ids=batch.prompt_ids.expand(M, -1), prompt_mask=batch.prompt_mask.expand(M, -1),
        **{f: _grp(getattr(batch, f), M, G) for f in
           ("tokens", "mask", "env_mask", "logprobs", "sum_pi_sq", "entropy", "lengths")},
        rewards=batch.rewards[0, : M * G].reshape(M, G), texts=[], prompts=[])
    mask = groups.mask != 0
    logp = groups.logprobs
    out = {}
    for label in labels:
        # otb's weights here are the proxy (no exact per-token norms without per-token grads).
        adv = group_advantages(label, groups.rewards.to(logp.dtype), mask, logp,
                               groups.sum_pi_sq, None)
        coef = torch.cat([
            -token_coefficients(logp[m : m + 1], logp[m : m + 1], adv[m : m + 1],
                                mask[m : m + 1], "seq-mean-token-sum", max_len=T)
            for m in range(M)])
        est = group_gradients(policy.model, groups, coef).double()
        out[label] = (est, variance_stats(est)["variance"])
    return out


def timed(fn, repeat, clock=time.process_time):
    ts = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("-M", type=int, default=6)
    ap.add_argument("-G", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sketch-dim", type=int, default=1024, help="0: flat vectors")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="process CPU time (default) or wall time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    policy = build_preset(args.preset, seed=0)
    task = get_task("sort")
    batch = sample(policy, task, task.prompts(1, seed=0), args.M * args.G, seed=0,
                   reward="positional")
    M, G = args.M, args.G
    # Same estimates either way (float32 model: agreement to ~1e-4 relative).
    a = run(policy, batch, SCHEMES, M, G)
    b = run_backward(policy, batch, SCHEMES, M, G)
    for s in SCHEMES:
        scale = float(b[s][0].abs().max())
        torch.testing.assert_close(a[s][0], b[s][0], rtol=1e-3, atol=1e-5 * scale)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    K = args.sketch_dim or None
    t_shared = timed(lambda: run(policy, batch, SCHEMES, M, G, K), args.repeat, clock)
    t_one = timed(lambda: run(policy, batch, ["centered"], M, G, K), args.repeat, clock)
    t_sep = timed(lambda: [run(policy, batch, [s], M, G, K) for s in SCHEMES], args.repeat,
                  clock)
    t_bwd1 = timed(lambda: run_backward(policy, batch, ["centered"], M, G), args.repeat, clock)
    t_bwd = timed(lambda: run_backward(policy, batch, SCHEMES, M, G), args.repeat, clock)
    n_tok = int(batch.mask[0, : M * G].sum())
    print(f"preset={args.preset} M={M} G={G} responses={M * G} tokens={n_tok} "
          f"threads={args.threads} sketch_dim={K} repeat={args.repeat} (median {args.clock} s; "
          "sampling excluded)")
    print(f"{'contender':<34}{'seconds':>10}")
    print(f"{'shared vectors, 7 schemes':<34}{t_shared:>10.3f}")
    print(f"{'one scheme (centered)':<34}{t_one:>10.3f}")
    print(f"{'recompute vectors per scheme, 7':<34}{t_sep:>10.3f}")
    print(f"{'group_gradients, one scheme':<34}{t_bwd1:>10.3f}")
    print(f"{'group_gradients per scheme, 7':<34}{t_bwd:>10.3f}")
    print(f"ratio shared(7) / one scheme      = {t_shared / t_one:.3f}  (target <= 1.5)")
    print(f"speed-up shared vs recompute (7)  = {t_sep / t_shared:.2f}x")
    print(f"shared(7) / group_gradients(7)    = {t_shared / t_bwd:.2f}  (group_gradients gives "
          "no exact per-token norms: otb_exact needs the per-token pass anyway)")


if __name__ == "__main__":
    main()
