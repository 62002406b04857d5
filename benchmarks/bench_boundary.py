"""Cost of the estimator boundary's tensor checks (``check_scheme_tensors``), side by side.

    .venv/bin/python benchmarks/bench_boundary.py                 # P*G = 4096, T = 1024
    .venv/bin/python benchmarks/bench_boundary.py --groups 128 --T 256

Times ``advantages(scheme, ...)`` with the checks (as shipped) and with them replaced by a
no-op, alternating the two in one process (best of --repeats: the machine is shared, the
minimum is the least disturbed measurement), and prints the ratio per scheme. The checks are
one finiteness reduction per tensor argument (a second, exact pass only when that total is not
finite) and one float64 max/min over the [P, G] rewards.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import varbench.estimators.registry as reg


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    P, G, T = args.groups, args.G, args.T
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, T + 1, (P, G), generator=gen)
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).float()
    rewards = torch.randn(P, G, generator=gen)
    w = torch.rand(P, G, T, generator=gen) * mask
    lp = -torch.rand(P, G, T, generator=gen) * mask
    spsq = torch.rand(P, G, T, generator=gen) * mask
    cases = {"centered": {}, "otb": {"token_weights": w},
             "otb[proxy]": {"logprobs": lp, "sum_pi_sq": spsq}}
    print(f"P={P} G={G} T={T} threads={torch.get_num_threads()} "
          f"load={os.getloadavg()[0]:.1f}")
    print(f"{'scheme':12} {'checked ms':>11} {'unchecked ms':>13} {'ratio':>7}")
    real = reg.check_scheme_tensors
    for label, kw in cases.items():
        scheme = label.split("[")[0]

        def call(kw=kw, scheme=scheme):
            reg.advantages(scheme, rewards, mask, **kw)

        call()
        checked, unchecked = float("inf"), float("inf")
        for _ in range(args.repeats):  # alternate: both see the same machine load
            reg.check_scheme_tensors = real
            checked = min(checked, _best(call, 1))
            reg.check_scheme_tensors = lambda *a, **k: None
            unchecked = min(unchecked, _best(call, 1))
        reg.check_scheme_tensors = real
        print(f"{label:12} {checked * 1e3:11.2f} {unchecked * 1e3:13.2f} "
              f"{checked / unchecked:7.3f}")


if __name__ == "__main__":
    main()
