"""CLI subcommands ``varbench proxy``, ``varbench variance``, ``varbench cancellation``.

Each subcommand is a one-case suite: its flags become the keys of a ``kind = "proxy"`` (etc.)
case, validated by the suite schema and run by the same executor as a suite case
(:mod:`varbench.app.executors`); then the report is written to ``--out`` and its headlines
printed. Defaults are small so each command finishes in a few minutes on 2 CPU cores (the
library defaults are larger: e.g. G in 2..32 for the variance analysis). Under ``torchrun`` the
proxy and variance analyses shard their work over the ranks; rank 0 writes the report.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from varbench.app.specs import STATES, add_policy_flags, parse_knobs


def _common(p: argparse.ArgumentParser, *, out: str, states: list[str]) -> None:
    p.add_argument("--preset", default="tiny", help="embedded policy preset (default: tiny)")
    p.add_argument("--policy", default=None, metavar="DIR",
                   help="a local Hugging Face checkpoint directory instead of the preset "
                        "(used as is: no random/warm states), or a preset name")
    p.add_argument("--states", nargs="+", default=states, choices=STATES,
                   help=f"preset states side by side (default: {' '.join(states)})")
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                   help="task knob, VALUE a TOML literal, e.g. --knob n=3 (repeatable)")
    p.add_argument("--reward", default=None, help="task reward (default: the task's first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=out, help=f"report directory (default: {out})")
    p.add_argument("--no-cache", action="store_true",
                   help="do not cache finished cells under OUT/cells (no resume)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars (default: on a terminal, off in CI)")
    p.add_argument("--plan", action="store_true",
                   help="print the responses and forward+backward passes the run would spend "
                        "(the notice every run prints to stderr first), then exit: nothing is "
                        "sampled, no policy is built")
    add_policy_flags(p)


def _policy_keys(args) -> dict[str, Any]:
    from varbench.models import presets

    if args.policy is None:
        return {"preset": args.preset}
    if args.policy in presets():
        return {"preset": args.policy}
    return {"preset": args.preset, "checkpoint": args.policy}


def _case(kind: str, args, keys: dict[str, Any]) -> dict[str, Any]:
    """The case table these flags describe (validated by the suite schema)."""
    from varbench.app.suite import parse_case

    body = {"name": kind, "kind": kind, **_policy_keys(args), "states": list(args.states),
            "dtype": args.dtype, "device": args.device,
            "trust_remote_code": args.trust_remote_code or None,
            "add_task_tokens": args.add_task_tokens or None,
            "knobs": parse_knobs(args.knob), "reward": args.reward, "seed": args.seed, **keys}
    return parse_case({k: v for k, v in body.items() if v is not None}, where="command line")


def _int_or_auto(flag: str, what: str, minimum: int | None = None):
    """A converter for ``flag``: ``auto``, or an integer (at least ``minimum`` when given; else
    the library checks its range); ``what`` names the integer in the error."""
    def convert(value: str) -> int | str:
        from varbench._util.checks import UsageError

        if value == "auto":
            return value
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or (minimum is not None and n < minimum):
            raise UsageError(f"{flag}={value!r} is not valid; give {what} or 'auto'")
        return n
    return convert


_sketch_dim_flag = _int_or_auto("--sketch-dim", "a non-negative integer K (0: flat vectors)")


def _run_case(kind: str, keys: dict[str, Any], convert: dict[str, Any] | None = None):
    """A handler running the case these flags describe inside torchrun's process group
    (one process outside torchrun); rank 0 writes the report and prints. ``convert``: per
    key, a function from the flag's string to the case's value (raising UsageError)."""

    def handler(args) -> int:
        from varbench._util.distributed import init_from_env, shutdown
        from varbench.app.executors import KINDS
        from varbench.report import write_report

        vals = {k: getattr(args, a) for k, a in keys.items()}
        for k, fn in (convert or {}).items():
            vals[k] = fn(vals[k])
        case = _case(kind, args, vals)
        if args.plan:
            from varbench.app.executors import KINDS, analysis_plan, register_estimators

            register_estimators(case.params)  # a MODULE:FUNCTION scheme is checked by name
            plan, label = analysis_plan(KINDS[kind], case.params)
            print(f"varbench {kind} --plan: {plan.text(label=label)}")
            return 0
        from varbench.app.runner import prepare_out_dir

        prepare_out_dir(Path(args.out))  # a file in the way: said now, not after the work
        rank, _ = init_from_env()
        try:
            results = KINDS[kind].execute(case.name, case.params, Path(args.out),
                                          args.progress, cache=not args.no_cache)
        finally:
            shutdown()
        if rank != 0:
            return 0
        out = write_report(results, args.out, title=f"varbench {kind}")
        for res in results:
            tag = f"[{res.name}] " if len(results) > 1 else ""
            for h in res.headlines[:12]:
                print(f"{tag}{h.text}")
            if len(res.headlines) > 12:
                print(f"... {len(res.headlines) - 12} more headlines in {out / 'report.md'}")
        print(f"report: {out / 'report.html'}  ({out / 'summary.json'})")
        return 0

    return handler


_TASK_HELP = ("a task name, MODULE:ATTR (a Task subclass or factory) or a data file "
              ".jsonl/.json/.csv/.parquet / datasets directory (default sort)")


def register(subparsers) -> None:
    """Add ``proxy``, ``variance`` and ``cancellation`` to the ``varbench`` CLI."""
    from varbench.analysis.variance import DEFAULT_SCHEMES
    from varbench.estimators.aggregation import AGGREGATION_MODES
    from varbench.stats.intervals import INTERVAL_METHODS

    p = subparsers.add_parser(
        "proxy", help="proxy w_t vs exact per-token gradient norms (correlations + CIs)",
        description="Correlate the Logit-Gradient Proxy with exact per-token, prefix and "
                    "sequence gradient norms at random init and warm-started, side by side.")
    p.add_argument("--task", default="sort", help=_TASK_HELP)
    p.add_argument("--prompts", type=int, default=4, help="prompts (default 4)")
    p.add_argument("-G", type=int, default=6, help="responses per prompt (default 6)")
    p.add_argument("--boot", type=int, default=200, help="bootstrap draws (default 200)")
    _common(p, out="reports/proxy", states=["random", "warm"])
    p.set_defaults(func=_run_case("proxy", {"task": "task", "n_prompts": "prompts", "G": "G",
                                            "n_boot": "boot"}))

    v = subparsers.add_parser(
        "variance", help="estimator variance / bias / MSE per scheme x G (paired design)",
        description="Variance, bias, MSE, cosine, SNR of group gradient estimates against an "
                    "exact (enumerated) or sampled reference. CLI defaults are smaller than "
                    "the library's (G 2 4 8 16 32, M 32, 2 prompts) to run in minutes on 2 cores.")
    v.add_argument("--task", default="sort", help=_TASK_HELP)
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
    v.add_argument("--sketch-dim", default="1024", metavar="K|0|auto",
                   help="count-sketch dim K; 0: flat vectors (exact contraction); auto: flat "
                        "up to 200k parameters, else 1024 (default 1024)")
    v.add_argument("--sketch-seed", type=int, default=0,
                   help="seed of the count sketch, independent of --seed (default 0)")
    v.add_argument("--M-cap", type=int, default=None,
                   help="adaptive M: largest groups per prompt (default: -M, no growth)")
    v.add_argument("--target-rel-se", type=float, default=None,
                   help="adaptive M: grow M in steps of -M until the headline quantities' "
                        "relative SE is at most this (default: off)")
    v.add_argument("--min-responses", default="auto", metavar="N|auto",
                   help="responses per prompt at least (M raised in steps of -M); auto: "
                        "4096 when a scheme reads the proxy weights (OTB-type), else 0")
    v.add_argument("--interval", default="studentized",
                   help=f"interval method: {' | '.join(INTERVAL_METHODS)} (default studentized)")
    v.add_argument("--n-boot", type=int, default=1000, help="bootstrap draws (default 1000)")
    v.add_argument("--level", type=float, default=0.95, help="interval level (default 0.95)")
    v.add_argument("--exact", default="auto",
                   help="exact cells from an enumerated response table: auto | never")
    v.add_argument("--table-limit", type=int, default=256,
                   help="largest enumerated token count for exact cells (default 256)")
    v.add_argument("--topk-k", type=int, default=1)
    _common(v, out="reports/variance", states=["warm"])
    v.set_defaults(func=_run_case("variance", {
        "task": "task", "schemes": "schemes", "Gs": "G", "modes": "modes", "M": "M",
        "n_prompts": "prompts", "reference": "reference", "n_ref": "n_ref",
        "sketch_dim": "sketch_dim", "sketch_seed": "sketch_seed", "M_cap": "M_cap",
        "target_rel_se": "target_rel_se", "min_responses": "min_responses",
        "interval": "interval", "n_boot": "n_boot",
        "level": "level", "exact": "exact", "table_limit": "table_limit",
        "topk_k": "topk_k"}, convert={"sketch_dim": _sketch_dim_flag,
                                                   "min_responses": _int_or_auto(
                                                       "--min-responses", "an integer >= 0",
                                                       minimum=0)}))

    c = subparsers.add_parser(
        "cancellation", help="shared-step token gradient cancellation diagnostics",
        description="Prefix-trie shared steps: residuals, weighting-induced residuals, gradient "
                    "cancellation ratios and per-token net weights across aggregation modes, "
                    "token vs sequence ratios, PPO inner steps and restoring transforms.")
    c.add_argument("--tasks", "--task", nargs="+", default=["arith", "toolsum"],
                   help="tasks (each a name, MODULE:ATTR or data file)")
    c.add_argument("--prompts", type=int, default=4)
    c.add_argument("-G", type=int, default=6)
    c.add_argument("--scheme", default="centered")
    c.add_argument("--inner-steps", nargs="+", type=int, default=[0, 3])
    c.add_argument("--sketch-dim", type=int, default=256, help="gradient sketch dim (0: none)")
    _common(c, out="reports/cancellation", states=["warm"])
    c.set_defaults(func=_run_case("cancellation", {
        "tasks": "tasks", "n_prompts": "prompts", "G": "G", "scheme": "scheme",
        "inner_steps": "inner_steps", "sketch_dim": "sketch_dim"}))
