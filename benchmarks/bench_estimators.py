"""Vectorised advantage schemes vs the Python-loop references, side by side in one process.

    .venv/bin/python benchmarks/bench_estimators.py            # P*G = 4096 responses, T = 1024
    .venv/bin/python benchmarks/bench_estimators.py --groups 1024 --G 4 --loop-groups 4

Prints per scheme: vectorised time (best of --repeats: the machine is shared, the minimum is the
least disturbed measurement), loop-reference time, speed-up
(target >= 50x) and time relative to ``centered`` (target: otb <= 3x). The loop reference is
timed on ``--loop-groups`` groups and scaled linearly to all P groups (it is per-group work;
the printout says so). ``--threads`` sets torch's intra-op threads (the header prints the
count and the load average). Inputs: random prefix masks (lengths uniform in [1, T]),
Gaussian outcome rewards, float32. ``otb``/``otb_loo`` get ``token_weights`` (w_t precomputed, as
``varbench.grads.forward_stats(...).proxy`` provides it); the ``otb[proxy]`` row instead passes
``logprobs`` and ``sum_pi_sq`` so the proxy w = 1 - 2 exp(logprobs) + sum_pi_sq is computed inside.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference_estimators import ref_advantages  # noqa: E402

import varbench.estimators as E  # noqa: E402


def make_inputs(P: int, G: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (P, G), generator=gen)
    mask = (torch.arange(T).expand(P, G, T) < lengths.unsqueeze(-1)).float()
    rewards = torch.randn(P, G, generator=gen)
    probs = torch.rand(P, G, T, generator=gen) * 0.9 + 0.05
    logprobs = probs.log() * mask
    sum_pi_sq = (probs**2 + (1 - probs) ** 2 / 8) * mask
    return rewards, mask, {"logprobs": logprobs, "sum_pi_sq": sum_pi_sq}


def variants() -> list[tuple[str, str]]:
    """(row label, scheme) pairs: every registered scheme, plus otb with the in-scheme proxy."""
    rows = [(name, name) for name in E.schemes()]
    return rows + [("otb[proxy]", "otb")]


def scheme_options(label: str, scheme: str, otb_opts: dict) -> dict:
    if label == "otb[proxy]":
        return otb_opts
    if scheme in ("otb", "otb_loo"):
        w = 1 - 2 * otb_opts["logprobs"].exp() + otb_opts["sum_pi_sq"]
        return {"token_weights": w}
    if scheme in ("topk", "passk"):
        return {"k": 2}
    return {}


def time_call(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, first-call dispatch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=512, help="P (prompts)")
    ap.add_argument("--G", type=int, default=8, help="responses per prompt")
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--loop-groups", type=int, default=8, help="groups timed in the loop ref")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--schemes", nargs="*", default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for the vectorised side (default: torch's "
                         "default). On an oversubscribed machine every multi-threaded op waits "
                         "for a descheduled worker, so --threads 1 compares single core to "
                         "single core (the loop reference is single-threaded Python)")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    P, G, T = args.groups, args.G, args.T
    rewards, mask, otb_opts = make_inputs(P, G, T, seed=0)
    binary = (rewards > 0).float()
    rows_wanted = [(lab, sch) for lab, sch in variants() if not args.schemes or lab in args.schemes]
    print(f"P x G = {P} x {G} = {P * G} responses, T = {T}, float32, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    scale = P / args.loop_groups
    print(f"loop reference timed on {args.loop_groups} of {P} groups, scaled x{scale:g} "
          "(per-group work)")
    rows = []
    for label, name in rows_wanted:
        r = binary if name == "passk" else rewards
        kw = scheme_options(label, name, otb_opts)
        t_vec = time_call(lambda r=r, kw=kw, name=name: E.advantages(name, r, mask, **kw),
                          args.repeats)
        n = args.loop_groups
        sub_kw = {k: v[:n] if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        t0 = time.perf_counter()
        ref = ref_advantages(name, r[:n].double(), mask[:n], **sub_kw)
        t_loop = (time.perf_counter() - t0) * P / n
        got = E.advantages(name, r[:n].double(), mask[:n],
                           **{k: v.double() if isinstance(v, torch.Tensor) else v
                              for k, v in sub_kw.items()})
        err = (got - ref).abs().max().item()
        rows.append((label, t_vec, t_loop, err))
    t_centered = next((t for n_, t, _, _ in rows if n_ == "centered"), float("nan"))
    print(f"{'scheme':<22}{'vectorised ms':>14}{'loop s (scaled)':>17}{'speed-up':>11}"
          f"{'x centered':>12}{'max|err| f64':>14}")
    for name, t_vec, t_loop, err in rows:
        print(f"{name:<22}{t_vec * 1e3:>14.2f}{t_loop:>17.1f}{t_loop / t_vec:>10.0f}x"
              f"{t_vec / t_centered:>11.2f}x{err:>14.1e}")
    ok_speed = all(t_loop / t_vec >= 50 for _, t_vec, t_loop, _ in rows)
    otb_ratio = next((t / t_centered for n_, t, _, _ in rows if n_ == "otb"), float("nan"))
    proxy_ratio = next((t / t_centered for n_, t, _, _ in rows if n_ == "otb[proxy]"),
                       float("nan"))
    verdict = "met" if otb_ratio <= 3 else "NOT met"
    print(f"targets: every speed-up >= 50x: {'met' if ok_speed else 'NOT met'}; "
          f"otb / centered = {otb_ratio:.2f} (target <= 3): {verdict}; "
          f"otb[proxy] / centered = {proxy_ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
