"""CLI subcommands ``varbench proxy``, ``varbench variance``, ``varbench cancellation``.

Thin: parse, build the policy states, call the analysis, write the report directory, print
the headlines. Defaults are small so each command finishes in a few minutes on 2 CPU cores
(the library defaults are larger: e.g. G in 2..32 for the variance analysis).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

_STATES = ("random", "warm")


def _kv(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--knob {item!r} is not valid; expected KEY=VALUE, e.g. n=4")
        k, v = item.split("=", 1)
        low = v.strip().lower()
        if low in ("true", "false"):
            out[k.strip()] = low == "true"
        else:
            try:
                out[k.strip()] = int(v)
            except ValueError:
                out[k.strip()] = v
    return out


def _common(p: argparse.ArgumentParser, *, out: str, states: list[str]) -> None:
    p.add_argument("--preset", default="tiny", help="embedded policy preset (default: tiny)")
    p.add_argument("--policy", default=None, metavar="DIR",
                   help="a local Hugging Face checkpoint directory instead of the preset "
                        "(used as is: no random/warm states)")
    p.add_argument("--states", nargs="+", default=states, choices=_STATES,
                   help=f"preset states side by side (default: {' '.join(states)})")
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                   help="task knob, e.g. --knob n=3 (repeatable)")
    p.add_argument("--reward", default=None, help="task reward (default: the task's first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=out, help=f"report directory (default: {out})")
    p.add_argument("--no-cache", action="store_true",
                   help="do not cache finished cells under OUT/cells (no resume)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars (default: on a terminal)")


def _states(args, task) -> dict[str, Any]:
    """{state label: Policy}: a checkpoint as is, or the preset at random init / warm-started."""
    from varbench.models import build_policy, load_policy

    if args.policy is not None:
        return {Path(args.policy).name: load_policy(args.policy)}
    out = {}
    for s in dict.fromkeys(args.states):
        if s == "random":
            out["random init"] = build_policy(args.preset, seed=args.seed)
        else:
            from varbench.train.warmstart import warm_start

            out["warm-started"] = warm_start(args.preset, task, seed=args.seed,
                                             progress=bool(args.progress))
    return out


def _finish(res, args) -> int:
    from varbench.report import write_report

    out = write_report([res], args.out, title=f"varbench {res.kind}")
    for h in res.headlines[:12]:
        print(h.text)
    if len(res.headlines) > 12:
        print(f"... {len(res.headlines) - 12} more headlines in {out / 'report.md'}")
    print(f"report: {out / 'report.html'}  ({out / 'summary.json'})")
    return 0


def _cache(args) -> str | None:
    return None if args.no_cache else str(Path(args.out) / "cells")


def _under_torchrun(body):
    """A handler ``body(args, rank, world)`` run in the process group torchrun describes.

    Outside torchrun this is one process (rank 0 of 1). Inside, the analysis shards its work
    over the ranks and gathers the records; only rank 0 writes the report and prints.
    """

    def handler(args) -> int:
        from varbench._util.distributed import init_from_env, shutdown

        rank, world = init_from_env()
        try:
            return body(args, rank, world)
        finally:
            shutdown()

    return handler


def _ranked_states(args, task, rank: int, world: int) -> dict[str, Any]:
    """Policy states built on every rank; rank 0 warm-starts first so the others hit its cache."""
    import torch.distributed as dist

    if world > 1 and rank != 0:
        dist.barrier()
    states = _states(args, task)
    if world > 1 and rank == 0:
        dist.barrier()
    if world > 1 and dist.get_backend() == "nccl":
        # NCCL: one GPU per rank (init_from_env set it from LOCAL_RANK); compute there too.
        import torch

        for pol in states.values():
            pol.model.to(torch.device("cuda", torch.cuda.current_device()))
    return states


def _proxy(args, rank: int, world: int) -> int:
    from varbench.analysis.proxy import proxy_correlation
    from varbench.tasks import get_task

    task = get_task(args.task, **_kv(args.knob))
    res = proxy_correlation(_ranked_states(args, task, rank, world), task,
                            n_prompts=args.prompts, G=args.G, reward=args.reward,
                            seed=args.seed, n_boot=args.boot, cache_dir=_cache(args),
                            progress=args.progress,
                            config={"preset": args.preset, "policy_path": args.policy})
    return _finish(res, args) if rank == 0 else 0


def _variance(args, rank: int, world: int) -> int:

    from varbench.analysis.variance import estimator_variance
    from varbench.report.result import AnalysisResult
    from varbench.tasks import get_task

    task = get_task(args.task, **_kv(args.knob))
    states = _ranked_states(args, task, rank, world)
    results: list[AnalysisResult] = []
    for state, pol in states.items():
        res = estimator_variance(
            pol, task, schemes=args.schemes, Gs=args.G, modes=args.modes, M=args.M,
            n_prompts=args.prompts, reward=args.reward, reference=args.reference,
            n_ref=args.n_ref, sketch_dim=None if args.sketch_dim == 0 else args.sketch_dim,
            topk_k=args.topk_k, seed=args.seed, cache_dir=_cache(args),
            progress=args.progress, config={"state": state, "preset": args.preset})
        res.name = f"variance ({state})"
        results.append(res)
    if rank != 0:
        return 0
    if len(results) == 1:
        return _finish(results[0], args)
    from varbench.report import write_report

    out = write_report(results, args.out, title="varbench variance")
    for r in results:
        for h in r.headlines[:6]:
            print(f"[{r.name}] {h.text}")
    print(f"report: {out / 'report.html'}  ({out / 'summary.json'})")
    return 0


_cmd_proxy = _under_torchrun(_proxy)  # exact norms sharded by sequence
_cmd_variance = _under_torchrun(_variance)  # prompts sharded by rank


def _cmd_cancellation(args) -> int:
    from varbench.analysis.cancellation import cancellation
    from varbench.tasks import get_task

    tasks = [get_task(t) for t in args.tasks]
    policies: dict[str, Any] = {}
    for t in tasks:
        st = _states(args, t)
        policies[t.name] = next(iter(st.values()))
    res = cancellation(policies, tasks, n_prompts=args.prompts, G=args.G, reward=args.reward,
                       scheme=args.scheme, inner_steps=args.inner_steps,
                       sketch_dim=None if args.sketch_dim == 0 else args.sketch_dim,
                       seed=args.seed, cache_dir=_cache(args), progress=args.progress,
                       config={"preset": args.preset, "state": args.states[0]})
    return _finish(res, args)


def register(subparsers) -> None:
    """Add ``proxy``, ``variance`` and ``cancellation`` to the ``varbench`` CLI."""
    from varbench.analysis.variance import DEFAULT_SCHEMES
    from varbench.estimators.aggregation import AGGREGATION_MODES

    p = subparsers.add_parser(
        "proxy", help="proxy w_t vs exact per-token gradient norms (correlations + CIs)",
        description="Correlate the Logit-Gradient Proxy with exact per-token, prefix and "
                    "sequence gradient norms at random init and warm-started, side by side.")
    p.add_argument("--task", default="sort")
    p.add_argument("--prompts", type=int, default=4, help="prompts (default 4)")
    p.add_argument("-G", type=int, default=6, help="responses per prompt (default 6)")
    p.add_argument("--boot", type=int, default=200, help="bootstrap draws (default 200)")
    _common(p, out="reports/proxy", states=["random", "warm"])
    p.set_defaults(func=_cmd_proxy)

    v = subparsers.add_parser(
        "variance", help="estimator variance / bias / MSE per scheme x G (paired design)",
        description="Variance, bias, MSE, cosine, SNR of group gradient estimates against an "
                    "exact (enumerated) or sampled reference. CLI defaults are smaller than "
                    "the library's (G 2 4 8 16 32, M 32, 2 prompts) to run in minutes on 2 cores.")
    v.add_argument("--task", default="sort")
    v.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES),
                   help="scheme labels; <scheme>_exact = OTB-type with exact weights")
    v.add_argument("-G", nargs="+", type=int, default=[2, 4, 8],
                   help="group sizes (default 2 4 8; the library default is 2 4 8 16 32)")
    v.add_argument("--modes", nargs="+", default=["seq-mean-token-sum"],
                   choices=list(AGGREGATION_MODES))
    v.add_argument("-M", type=int, default=16, help="independent groups per prompt (default 16)")
    v.add_argument("--prompts", type=int, default=1, help="prompts (default 1)")
    v.add_argument("--reference", default="auto", choices=["auto", "exact", "sampled"])
    v.add_argument("--n-ref", type=int, default=1024, help="sampled reference size")
    v.add_argument("--sketch-dim", type=int, default=1024, help="count-sketch dim (0: flat)")
    v.add_argument("--topk-k", type=int, default=1)
    _common(v, out="reports/variance", states=["warm"])
    v.set_defaults(func=_cmd_variance)

    c = subparsers.add_parser(
        "cancellation", help="shared-step token gradient cancellation diagnostics",
        description="Prefix-trie shared steps: residuals, weighting-induced residuals, gradient "
                    "cancellation ratios and per-token net weights across aggregation modes, "
                    "token vs sequence ratios, PPO inner steps and restoring transforms.")
    c.add_argument("--tasks", nargs="+", default=["arith", "toolsum"])
    c.add_argument("--prompts", type=int, default=4)
    c.add_argument("-G", type=int, default=6)
    c.add_argument("--scheme", default="centered")
    c.add_argument("--inner-steps", nargs="+", type=int, default=[0, 3])
    c.add_argument("--sketch-dim", type=int, default=256, help="gradient sketch dim (0: none)")
    _common(c, out="reports/cancellation", states=["warm"])
    c.set_defaults(func=_cmd_cancellation)

