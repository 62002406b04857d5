"""CLI: ``varbench run``, ``varbench merge``, ``varbench compare``, ``varbench check``.

Exit codes: 0 success / pass; 1 a check failed (also a ``check`` case of ``run``, and an
estimator that called ``exit()`` or ``os._exit()``: a FAIL row) or a comparison found a
regression; 2 bad input (unknown file, invalid suite, a suite naming code without
``--allow-code``, module not found, wrong signature, a case whose user code tried to end the
process: the message says which); 130 interrupted (``check``: a FAIL row, no verdict; ``run``:
finished cases stay cached, rerun the same command to resume). Never 0 unless every selected
case finished.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from varbench._util.bounds import argtype
from varbench.app.specs import DEVICE_HELP, DTYPES, STATES, add_policy_flags, resolve_device


def register(sub: argparse._SubParsersAction) -> None:
    """Add the runner's subcommands to the top-level parser."""
    p = sub.add_parser("run", help="run a suite (cached, resumable) and write its report",
                       description="Run every case of SUITE.toml not already cached in --out, "
                       "then write summary.json, report.md and report.html there.")
    p.add_argument("suite", metavar="SUITE.toml")
    p.add_argument("--out", default=None, help="output directory (default reports/<suite name>)")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="run only shard I of N (1-based; cases I-1, I-1+N, ...); no report: "
                   "combine shards with `varbench merge`")
    p.add_argument("--device", default=None,
                   help=f"device of every case that names none: {DEVICE_HELP}")
    p.add_argument("--allow-code", action="store_true",
                   help="let the suite name code: MODULE:ATTR tasks, schemes, estimators and "
                   "verifiers, trust_remote_code = true (without it such a suite is refused, "
                   "with the list of entries)")
    p.add_argument("--plan", action="store_true",
                   help="print what each analysis case would spend (responses, forward+backward "
                   "passes) and exit: nothing runs")
    p.set_defaults(func=_run)

    p = sub.add_parser("merge", help="combine shard outputs into one report")
    p.add_argument("dirs", nargs="+", metavar="DIR")
    p.add_argument("--out", required=True, help="output directory of the merged report")
    p.set_defaults(func=_merge)

    p = sub.add_parser("compare", help="compare two reports figure by figure (exit 1 on a "
                       "regression beyond tolerance)")
    p.add_argument("baseline", metavar="BASELINE", help="report directory or summary.json")
    p.add_argument("new", metavar="NEW", help="report directory or summary.json")
    p.add_argument("--tolerance", type=argtype("tolerance", "--tolerance"), default=3.0,
                   help="allowed difference in combined standard errors (default 3)")
    p.add_argument("--rel-tolerance", type=argtype("rel_tolerance", "--rel-tolerance"),
                   default=0.01,
                   help="allowed relative difference added to it (default 0.01)")
    p.add_argument("--abs-tolerance", type=argtype("abs_tolerance", "--abs-tolerance"),
                   default=1e-9)
    p.set_defaults(func=_compare)

    p = sub.add_parser("check", help="regression-test advantage estimators (exit 0 pass, "
                       "1 fail, 2 bad input)")
    p.add_argument("estimators", nargs="+", metavar="MODULE:FUNCTION",
                   help="a function (scheme-, keyword- or verl-shaped) or a registered scheme "
                   "name")
    p.add_argument("-G", type=argtype("G", "-G"), default=4, help="group size (default 4)")
    p.add_argument("--steps", type=argtype("num_steps", "--steps"), default=None,
                   help="sampled steps (groups per prompt) for the bias test (default 3000 on "
                   "the toy task, 64 with --policy/--task)")
    p.add_argument("--seed", type=argtype("seed", "--seed"), default=0)
    p.add_argument("--alpha", type=argtype("alpha", "--alpha"), default=1e-3,
                   help="false-alarm rate of each bias test (default 0.001)")
    p.add_argument("--tolerance", type=argtype("tolerance", "--tolerance"), default=0.05,
                   help="relative bias that is flagged when significant (default 0.05)")
    p.add_argument("--baselines", default="centered,otb",
                   help="comma-separated schemes for the variance comparison")
    p.add_argument("--require-unbiased", action="store_true",
                   help="also require the raw (unrescaled) bias test to pass")
    p.add_argument("--max-variance-ratio", default=None,
                   type=argtype("max_variance_ratio", "--max-variance-ratio"),
                   help="fail when the variance ratio to a baseline exceeds this")
    p.add_argument("--device", default=None,
                   help="where the estimators run (the toy task stays on the cpu; with --policy "
                   f"the policy runs there too): {DEVICE_HELP}")
    g = p.add_argument_group(
        "your policy and task (instead of the toy task: the bias test against a reference "
        "sampled from the policy on the task's prompts)")
    g.add_argument("--policy", default=None, metavar="CKPT_OR_PRESET",
                   help="a local checkpoint directory (used as is) or a preset (default with "
                   "--task: tiny)")
    g.add_argument("--task", default=None, metavar="SPEC",
                   help="a task name, MODULE:ATTR or data file (default with --policy: sort)")
    g.add_argument("--state", default="warm", choices=list(STATES),
                   help="a preset's state: random init or warm-started on the task (default "
                   "warm)")
    g.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                   help="task knob, VALUE a TOML literal (repeatable)")
    g.add_argument("--reward", default=None, help="task reward (default: the task's first)")
    g.add_argument("--prompts", type=argtype("n_prompts", "--prompts"), default=None,
                   help="prompts (default 4)")
    g.add_argument("--n-ref", type=argtype("n_ref", "--n-ref"), default=None,
                   help="reference responses per prompt (default 1024)")
    g.add_argument("--sketch-dim", type=int, default=None,
                   help="count-sketch dim of the gradients, 0: flat (default 256)")
    g.add_argument("--dtype", default="auto", choices=list(DTYPES),
                   help="model dtype (default auto: the checkpoint's own)")
    add_policy_flags(g, dtype=False)
    p.set_defaults(func=_check)


def _run(args: argparse.Namespace) -> int:
    from varbench._util.checks import UsageError
    from varbench._util.distributed import env_world_size, init_from_env, shutdown
    from varbench.app.runner import parse_shard, plan_suite, run_suite, run_suite_ranks

    shard = parse_shard(args.shard) if args.shard else None
    world = env_world_size()
    if world > 1 and (shard is not None or args.plan):
        flag = "--shard" if shard is not None else "--plan"
        raise UsageError(f"{flag} with WORLD_SIZE={world} (torchrun): the ranks split the suite "
                         "themselves (rank r runs shard r+1/WORLD_SIZE into --out, rank 0 then "
                         "writes the report); drop it, or run it as one process")
    if args.plan:
        for line in plan_suite(args.suite, device=args.device, allow_code=args.allow_code):
            print(line)
        return 0
    if world > 1:
        rank, _ = init_from_env()
        try:
            summary = run_suite_ranks(args.suite, args.out, device=args.device,
                                      allow_code=args.allow_code,
                                      log=lambda m: print(f"rank {rank}: {m}", flush=True))
        finally:
            shutdown()
        if rank != 0:  # rank 0 prints the summary of every rank's cases
            return 1 if summary.failed else 0
    else:
        summary = run_suite(args.suite, args.out, shard=shard,
                            log=lambda m: print(m, flush=True), device=args.device,
                            allow_code=args.allow_code)
    print(f"{len(summary.computed)} case(s) computed, {len(summary.cached)} cached, "
          f"{summary.wall_time_s:.1f} s")
    if summary.report is not None:
        print(f"report: {summary.report}")
    else:
        print(f"shard {args.shard} written to {summary.out_dir}; combine the shards with "
              "`varbench merge DIR... --out DIR`")
    if summary.failed:
        print(f"{len(summary.failed)} check case(s) FAILED: {', '.join(summary.failed)}",
              file=sys.stderr)
        return 1
    return 0


def _merge(args: argparse.Namespace) -> int:
    from varbench.app.runner import merge_outputs

    summary = merge_outputs(args.dirs, args.out)
    print(f"merged {len(summary.cached)} case(s); report: {summary.report}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from varbench.app.compare import compare_reports, regressions

    table = compare_reports(args.baseline, args.new, tolerance=args.tolerance,
                            rel_tolerance=args.rel_tolerance, abs_tolerance=args.abs_tolerance)
    bad = regressions(table)
    with pd.option_context("display.max_rows", None, "display.width", 160):
        print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"{len(table)} figure(s), {len(bad)} beyond tolerance")
    return 1 if len(bad) else 0


def _check(args: argparse.Namespace) -> int:
    from varbench._util.distributed import init_from_env, shutdown
    from varbench.testing.adapt import load
    from varbench.testing.check import check_estimator, check_estimator_sampled

    baselines = tuple(b for b in args.baselines.split(",") if b)
    sampled = _sampled_options(args)  # bad flags, task or policy -> exit 2 before any work
    for ref in args.estimators:  # bad input for any of them -> exit 2 before running anything
        load(ref)
    for b in baselines:
        load(b)
    rank, _ = init_from_env()  # under torchrun: the sampled steps are split across ranks
    failed = 0
    try:
        device = resolve_device(args.device)  # after joining: a rank's own GPU under NCCL
        common = {"G": args.G, "seed": args.seed, "alpha": args.alpha,
                  "tolerance": args.tolerance, "baselines": baselines,
                  "require_unbiased": args.require_unbiased,
                  "max_variance_ratio": args.max_variance_ratio, "device": device}
        if sampled is not None:
            policy, task, opts = _sampled_setup(args, sampled, device)
        for ref in args.estimators:
            try:
                if sampled is None:
                    res = check_estimator(ref, num_steps=args.steps or 3000, **common)
                else:
                    res = check_estimator_sampled(ref, policy, task, **opts, **common)
            except KeyboardInterrupt:  # Ctrl-C, or the estimator raised it: no verdict
                print(f"check_estimator: {ref}\nFAIL    finished: interrupted "
                      "(KeyboardInterrupt) before every check ran: no verdict\nFAILED",
                      flush=True)
                return 130
            if rank == 0:
                print(res, flush=True)
            failed += not res.passed
    finally:
        shutdown()
    if len(args.estimators) > 1 and rank == 0:
        print(f"{len(args.estimators) - failed} passed, {failed} failed", file=sys.stderr)
    return 1 if failed else 0


_SAMPLED_FLAGS = {"knob": "--knob", "reward": "--reward", "prompts": "--prompts",
                  "n_ref": "--n-ref", "sketch_dim": "--sketch-dim"}


def _sampled_options(args: argparse.Namespace) -> dict | None:
    """The task's knobs for the sampled bias test (``--policy`` / ``--task``), checked before
    any work; None on the toy task (where the sampled-test flags are refused, not ignored)."""
    from varbench._util.checks import UsageError
    from varbench.app.specs import check_task_spec, parse_knobs
    from varbench.train.policies import check_policy_spec

    if args.policy is None and args.task is None:
        given = [flag for key, flag in _SAMPLED_FLAGS.items() if getattr(args, key)]
        given += [f for f, v in (("--trust-remote-code", args.trust_remote_code),
                                 ("--add-task-tokens", args.add_task_tokens),
                                 ("--dtype", args.dtype != "auto")) if v]
        if given:
            raise UsageError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to "
                             "your policy and task: pass --policy and/or --task (without them "
                             "check runs on its toy task)")
        return None
    knobs = parse_knobs(args.knob)
    check_task_spec(args.task or "sort", knobs)
    check_policy_spec(args.policy or "tiny")
    return knobs


def _sampled_setup(args: argparse.Namespace, knobs: dict, device) -> tuple:
    """``(policy, task, options)`` of ``check_estimator_sampled``: the task and the policy
    resolved as every command resolves them (a preset at ``--state``)."""
    from varbench.analysis.cancellation import CancellationConfig
    from varbench.app.specs import policy_kwargs, policy_states, resolve_task

    task = resolve_task(args.task or "sort", knobs)
    kw = {**policy_kwargs(args), "device": device}
    policy = next(iter(policy_states(args.policy or "tiny", [args.state], task, seed=args.seed,
                                     **kw).values()))
    # the per-token gradient sketch of the cancellation analysis (same default, same "0: no
    # sketch"): its declared field normalises the flag, the one place 0 becomes None
    sketch = CancellationConfig.check_field(
        "sketch_dim", 256 if args.sketch_dim is None else args.sketch_dim, arg="--sketch-dim")
    opts = {"num_steps": args.steps or 64, "n_prompts": args.prompts or 4,
            "n_ref": args.n_ref or 1024, "sketch_dim": sketch, "reward": args.reward}
    return policy, task, opts
