"""CLI subcommands ``varbench train`` and ``varbench validate`` (thin: parse, call, print).

``varbench train`` takes every TrainConfig field as a flag (``--scheme otb -G 4``), optionally on
top of a TOML file (``--config run.toml``; flags win), writes ``OUT/records.csv`` and
checkpoints, and ``--resume`` continues an interrupted run in the same ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from varbench._util.bounds import KNOBS, argtype
from varbench._util.checks import UsageError, check_positive_int
from varbench.app.specs import DEVICE_HELP, add_policy_flags, parse_knobs, resolve_device
from varbench.train.config import TrainConfig, field_docs

_SHORT = {"G": "-G"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field (defaults None: only given flags override)."""
    g = parser.add_argument_group("training settings (TrainConfig fields; see --config)")
    docs = field_docs()
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        if f.name in ("task_options", "scheme_options"):
            continue
        names = [_flag(f.name)] + ([_SHORT[f.name]] if f.name in _SHORT else [])
        kind = f.type
        if kind == "bool":
            g.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=None, help=f"{docs.get(f.name, '')} (default: "
                           f"{getattr(defaults, f.name)})".replace("%", "%%"))
        elif f.name == "device":  # default: cuda when available (config_from_args)
            g.add_argument(*names, dest=f.name, default=None, metavar="DEVICE",
                           help=DEVICE_HELP.replace("%", "%%"))
        else:
            conv = (argtype(f.name, names[-1]) if f.name in KNOBS  # bounds: one declaration
                    else {"int": int, "float": float}.get(kind, str))
            g.add_argument(*names, dest=f.name, type=conv, default=None, metavar=f.name.upper(),
                           help=f"{docs.get(f.name, '')} (default: "
                           f"{getattr(defaults, f.name)})".replace("%", "%%"))
    g.add_argument("--knob", dest="task_option", action="append", default=[],
                   metavar="KEY=VALUE", help="task knob, VALUE a TOML literal, e.g. --knob n=4 "
                   "(repeatable)")
    g.add_argument("--scheme-option", action="append", default=[], metavar="KEY=VALUE",
                   help="scheme option, e.g. --scheme-option k=2 (repeatable)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from ``--config`` (or, on ``--resume``, the run's own config.json) overridden
    by the flags given."""
    saved = Path(args.out) / "config.json" if getattr(args, "out", None) else None
    if getattr(args, "config", None):
        _refuse_config_code(args.config, allow_code=getattr(args, "allow_code", False))
        base = TrainConfig.from_toml(args.config)
        device_set = _toml_sets_device(args.config)
    elif getattr(args, "resume", False) and saved is not None and saved.is_file():
        # --resume without --config continues the run with the settings it was started with
        try:
            data = json.loads(saved.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise UsageError(f"{str(saved)!r} is not valid JSON ({err}): the run's config is "
                             "damaged; restore it, or pass --config with the run's settings"
                             ) from None
        base = TrainConfig.from_dict(data, source=str(saved))
        device_set = True  # the run's own device
    else:
        base = TrainConfig()
        device_set = False
    data = base.to_dict()
    if not device_set:  # neither flag nor file names one: cuda when available, else cpu
        data["device"] = str(resolve_device(None))
    for f in fields(TrainConfig):
        value = getattr(args, f.name, None)
        if value is not None and f.name not in ("task_options", "scheme_options"):
            data[f.name] = value
    data["task_options"].update(parse_knobs(args.task_option, flag="--knob"))
    data["scheme_options"].update(parse_knobs(args.scheme_option, flag="--scheme-option"))
    from varbench.app.executors import register_estimators

    register_estimators(data)  # a user's MODULE:FUNCTION scheme, imported by name
    return TrainConfig.from_dict(data, source="command line")


def _refuse_config_code(path: str, *, allow_code: bool) -> None:
    """A ``--config`` file naming code (a ``MODULE:ATTR`` task, scheme or verifier,
    ``trust_remote_code = true``) is refused, with the list of entries, unless
    ``--allow-code`` is given: the rule of a suite file (:func:`varbench.app.suite.code_refs`).
    The command line's own flags are the user's and need no opt-in."""
    import sys

    from varbench.app.suite import code_refs, refuse_code

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    file = Path(path)
    if not file.is_file():
        return  # TrainConfig.from_toml names the missing file
    try:
        data = tomllib.loads(file.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return  # TrainConfig.from_toml names the error
    refuse_code(path, code_refs("config", data), allow_code=allow_code, what="config",
                how="--allow-code")


def _toml_sets_device(path: str) -> bool:
    """Whether the TrainConfig TOML file at ``path`` (already read once) names a device."""
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return "device" in tomllib.loads(Path(path).read_text())


_RUN_FILES = ("records.csv", "config.json", "checkpoints")


def _refuse_existing_run(out: Path, *, resume: bool, overwrite: bool) -> None:
    """A run already in ``out`` is continued (``--resume``), set aside (``--overwrite``: moved
    to ``OUT.replaced-N``, nothing deleted) or refused: a new run would replace its records."""
    from varbench._util.checks import UsageError

    if resume and overwrite:
        raise UsageError("--resume and --overwrite are exclusive: continue the run in --out, "
                         "or start a new one there")
    found = [f for f in _RUN_FILES if (out / f).exists()] if out.is_dir() else []
    if not found or resume:
        return
    if not overwrite:
        raise UsageError(f"--out={str(out)!r} already holds a run ({', '.join(found)}); pass "
                         "--resume to continue it or --overwrite to start anew (the old run is "
                         "moved aside, not deleted)")
    n = 1
    while out.with_name(f"{out.name}.replaced-{n}").exists():
        n += 1
    aside = out.with_name(f"{out.name}.replaced-{n}")
    out.rename(aside)
    print(f"--overwrite: the previous run in {str(out)!r} was moved to {str(aside)!r}")


def _cmd_train(args: argparse.Namespace) -> int:
    """``varbench train``; under torchrun (WORLD_SIZE > 1) data-parallel over the ranks
    (:mod:`varbench.train.parallel`), rank 0 writing ``--out`` and printing."""
    from varbench._util.distributed import env_world_size, init_from_env, shutdown
    from varbench.train.parallel import check_world

    out = Path(args.out)
    world = env_world_size()
    if world == 1:
        _refuse_existing_run(out, resume=args.resume,
                             overwrite=getattr(args, "overwrite", False))
        return _train_and_print(args, out, config_from_args(args), rank=0)
    check_world(config_from_args(args), world)  # bad input: exit 2 before any rank joins
    rank, _ = init_from_env()
    try:
        # after joining: the default --device is the rank's own (cuda:LOCAL_RANK or cpu)
        config = config_from_args(args)
        _lead_refuses_existing_run(args, out, rank)
        return _train_and_print(args, out, config, rank=rank)
    finally:
        shutdown()


def _lead_refuses_existing_run(args: argparse.Namespace, out: Path, rank: int) -> None:
    """:func:`_refuse_existing_run` on rank 0 only (it may move ``out`` aside); its refusal,
    if any, raised on every rank alike (no rank is left waiting for the others)."""
    from varbench._util.distributed import broadcast_object

    problem = None
    if rank == 0:
        try:
            _refuse_existing_run(out, resume=args.resume,
                                 overwrite=getattr(args, "overwrite", False))
        except UsageError as err:
            problem = str(err)
    problem = broadcast_object(problem)
    if problem is not None:
        raise UsageError(problem)


def _train_and_print(args: argparse.Namespace, out: Path, config: TrainConfig, *,
                     rank: int) -> int:
    """Train ``config`` into ``out``; rank 0 prints the run's summary."""
    from varbench.train.loop import train

    result = train(config, out, resume=args.resume)
    if rank != 0:
        return 0
    df = result.records
    ev = df.dropna(subset=["eval/acc_sampled"])
    first, last = ev.iloc[0], ev.iloc[-1]
    print(f"run: {out}  ({len(df) - 1} steps, stopped by {result.stopped})")
    print(f"records: {out / 'records.csv'}")
    print(f"sampled tokens: {int(df['tokens/sampled'].iloc[-1])}  "
          f"env tokens: {int(df['tokens/env'].iloc[-1])}")
    print(f"held-out accuracy (sampled): {first['eval/acc_sampled']:.3f} at step "
          f"{int(first['step'])} -> {last['eval/acc_sampled']:.3f} at step {int(last['step'])}")
    print(f"held-out accuracy (greedy):  {first['eval/acc_greedy']:.3f} -> "
          f"{last['eval/acc_greedy']:.3f}")
    surge = int(df["collapse/grad_surge"].fillna(0).sum())
    entropy = int(df["collapse/entropy"].fillna(0).sum())
    print(f"collapse flags: grad-norm surge at {surge} step(s), entropy collapse at {entropy}")
    return 0


def validate_config(args: argparse.Namespace):
    """The validation experiment's config: reduced or full defaults, overridden by the flags."""
    from varbench._util.bounds import check_knob
    from varbench.analysis.validate import ValidateConfig

    if args.threshold_frac is not None:  # before anything else is asked for
        check_knob("threshold_frac", args.threshold_frac, arg="--threshold-frac")
    own = _user_tasks(args)  # --task LABEL=SPEC: checked before --budget is asked for
    cfg = ValidateConfig.reduced_default() if args.reduced else ValidateConfig()
    if getattr(args, "suite", None):
        cfg = suite_validate_config(args.suite, args.case, reduced=args.reduced,
                                    allow_code=getattr(args, "allow_code", False))
    changes: dict[str, Any] = {}
    if own:
        changes["task_specs"] = {**cfg.task_specs, **own}
        changes["tasks"] = tuple(own)
    for name, conv in (("tasks", str), ("schemes", str), ("Gs", int), ("seeds", int)):
        raw = getattr(args, name.lower(), None)
        if raw:
            changes[name] = tuple(conv(x) for x in raw.split(","))
    budgets = dict(cfg.budgets)
    for task, n in parse_knobs(args.budget, flag="--budget").items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UsageError(f"--budget {task}={n!r} is not valid; expected TASK=TOKENS with "
                             "TOKENS an integer >= 1, e.g. sort=24000")
        budgets[task] = n
    changes["budgets"] = budgets
    if args.threshold_frac is not None:
        changes["threshold_frac"] = args.threshold_frac
    base = dict(cfg.base)
    if args.policy is not None:
        from varbench.train.policies import check_policy_spec, is_checkpoint_dir

        check_policy_spec(args.policy, arg="--policy")
        # a checkpoint directory is warm-started like a preset (its tasks need demonstrations)
        base.update(policy=args.policy, warm_start_dir=is_checkpoint_dir(args.policy))
    for key in ("dtype", "device"):
        if getattr(args, key, None) is not None:
            base[key] = getattr(args, key)
    base["device"] = str(resolve_device(base.get("device")))  # default: cuda when available
    if args.trust_remote_code:
        base["trust_remote_code"] = True
    if args.add_task_tokens:
        base["add_task_tokens"] = True
    if base != cfg.base:
        TrainConfig.from_dict(base, source="validate flags")
        changes["base"] = base
    if args.no_prediction:
        changes["prediction"] = False
    cfg = dataclasses.replace(cfg, **changes)
    from varbench.analysis.validate import check_task_label

    for t in cfg.tasks:  # which tasks it accepts said before any budget is asked for
        check_task_label(cfg, t)
    for t in cfg.tasks:
        if t not in cfg.budgets:
            raise UsageError(f"--budget: no token budget for task {t!r}; add {t}=N")
    return cfg


def _user_tasks(args: argparse.Namespace) -> dict[str, dict]:
    """``{label: {"task": SPEC, **knobs}}`` from ``--task LABEL=SPEC`` (repeatable) and the
    ``--knob`` flags applied to each, every spec checked now (a user's MODULE:ATTR imported and
    checked by type, not called); the labels name the runs (and ``--budget LABEL=N``)."""
    from varbench._util.io import safe_name
    from varbench.app.specs import check_task_spec

    knobs = parse_knobs(getattr(args, "knob", None))
    if knobs and not getattr(args, "task", None):
        raise UsageError("--knob applies to the tasks given with --task LABEL=SPEC; give one")
    out: dict[str, dict] = {}
    for text in getattr(args, "task", None) or []:
        label, sep, spec = str(text).partition("=")
        label, spec = label.strip(), spec.strip()
        if not sep or not label or not spec:
            raise UsageError(f"--task {text!r} is not valid; expected LABEL=SPEC, e.g. "
                             "gsm=data/gsm.jsonl (SPEC: a task name, MODULE:ATTR or data file; "
                             "LABEL names its runs and its --budget)")
        safe_name("--task label", label)
        check_task_spec(spec, knobs)
        out[label] = {"task": spec, **knobs}
    return out


def suite_validate_config(path: str, case: str | None, *, reduced: bool = False,
                          allow_code: bool = False):
    """The ValidateConfig of a suite's ``validate`` case (the only one, or the one named);
    ``allow_code``: the file may name code (``--allow-code``, as for ``varbench run``)."""
    from varbench.analysis.validate import ValidateConfig
    from varbench.app.suite import load_suite

    cases = [c for c in load_suite(path, allow_code=allow_code).cases if c.kind == "validate"]
    names = [c.name for c in cases]
    if case is not None:
        cases = [c for c in cases if c.name == case]
    if len(cases) != 1:
        raise UsageError(f"--suite {path!r}: " + (
            f"no validate case named {case!r}; its validate cases: {names}" if case
            else f"has {len(names)} validate cases {names}; name one with --case"))
    params = dict(cases[0].params)
    if reduced:
        params["reduced"] = True
    return ValidateConfig.from_params(params)


def _add_validate_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``varbench validate``."""
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--reduced", action="store_true",
                   help="the minutes-long setting (2 schemes, G 4/32, 2 seeds, small budgets)")
    p.add_argument("--tasks", help="comma list of task labels, e.g. sort,toolsum (registered "
                   "names, or labels of --task / the suite's task_specs)")
    p.add_argument("--task", action="append", default=None, metavar="LABEL=SPEC",
                   help="your task under a label (repeatable; the grid's tasks unless --tasks "
                   "is given): SPEC a task name, MODULE:ATTR or a data file; give its budget "
                   "with --budget LABEL=TOKENS")
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                   help="task knob of every --task, VALUE a TOML literal (repeatable)")
    p.add_argument("--schemes", help="comma list of registered schemes")
    p.add_argument("--gs", help="comma list of group sizes, e.g. 4,8,32")
    p.add_argument("--seeds", help="comma list of seeds, e.g. 0,1,2")
    p.add_argument("--budget", action="append", metavar="TASK=TOKENS",
                   help="sampled-token budget per run for a task (repeatable)")
    p.add_argument("--threshold-frac", type=float, default=None,
                   help="threshold = warm-start acc + FRAC x (1 - acc)")
    p.add_argument("--no-prediction", action="store_true",
                   help="skip the warm-start variance analysis (prediction check)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: tiny models gain nothing from more)")
    p.add_argument("--policy", default=None,
                   help="a preset or a local checkpoint directory (warm-started on each task)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float64"],
                   help="training dtype (bfloat16: float32 master weights and AdamW states)")
    p.add_argument("--device", default=None, help=f"torch device of the runs: {DEVICE_HELP}")
    p.add_argument("--suite", default=None, metavar="TOML",
                   help="take the grid from this suite's validate case (flags still override)")
    p.add_argument("--case", default=None, help="the validate case of --suite, by name")
    p.add_argument("--allow-code", action="store_true",
                   help="let the --suite file name code (MODULE:ATTR tasks, schemes, verifiers, "
                   "trust_remote_code = true), as `varbench run --allow-code`")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="run only runs I-1, I-1+N, ... (1-based) into --out; no report")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: build the report from the finished runs in --out")
    p.add_argument("--report-dir", default=None, metavar="DIR",
                   help="write the report here (default --out; the runs stay in --out)")
    p.add_argument("--plan", action="store_true",
                   help="print the grid's run count and estimated wall time; train nothing")
    p.add_argument("--timing-from", default=None, metavar="DIR",
                   help="--plan: measured runs to estimate from (default --out)")
    p.add_argument("--speedup", type=float, action="append", default=None,
                   help="--plan: also estimate at this factor of the measured speed "
                   "(repeatable)")
    p.add_argument("--power-from", default=None, metavar="DIR",
                   help="print the seeds and budgets each saving claim needs, from the pilot "
                   "runs in DIR; train nothing")
    p.add_argument("--shards", type=int, default=1,
                   help="--plan: estimate the slowest of this many shards")
    add_policy_flags(p, dtype=False)


def _cmd_validate(args: argparse.Namespace) -> int:
    import torch

    from varbench._util.distributed import env_world_size, init_from_env, shutdown
    from varbench.app.validation import finished_runs, run_validation

    if args.threads < 1:
        raise UsageError(f"--threads={args.threads} is not valid; expected an integer >= 1")
    torch.set_num_threads(args.threads)
    world = env_world_size()
    if world > 1:
        given = [f for f, v in (("--shard", args.shard), ("--report-only", args.report_only),
                                ("--plan", args.plan), ("--power-from", args.power_from)) if v]
        if given:
            raise UsageError(f"{', '.join(given)} with WORLD_SIZE={world} (torchrun): the ranks "
                             "split the runs themselves (rank r runs shard r+1/WORLD_SIZE, rank "
                             "0 then builds the report); drop it, or run it as one process")
        rank, _ = init_from_env()
        try:
            return _validate_on_ranks(args, rank)
        finally:
            shutdown()
    cfg = validate_config(args)
    if args.power_from:
        from varbench.analysis.validate_plan import power_text

        print(power_text(cfg, finished_runs(args.power_from)))
        return 0
    if args.plan:
        from varbench.analysis.validate_plan import plan_text, timing_from_runs

        timing = timing_from_runs(finished_runs(args.timing_from or args.out))
        print(plan_text(cfg, timing, speedups=[1.0, *(args.speedup or [])],
                        shards=check_positive_int("--shards", args.shards)))
        return 0
    from varbench.app.runner import parse_shard

    shard = parse_shard(args.shard) if args.shard else None
    if shard is not None and args.report_only:
        raise UsageError("--shard and --report-only exclude each other: shards train, the "
                         "report is built once from all of them")
    report_dir = Path(args.report_dir) if args.report_dir else None
    summary = run_validation(cfg, Path(args.out), progress=None, shard=shard,
                             report_only=args.report_only, report_dir=report_dir)
    print(summary)
    if shard is None:
        print(f"report: {(report_dir or Path(args.out)) / 'report.md'}")
    return 0


def _validate_on_ranks(args: argparse.Namespace, rank: int) -> int:
    """``varbench validate`` under torchrun: rank r trains shard (r+1, W) of the grid's runs
    alone (no collectives inside a run) into ``--out``; once every rank has finished, rank 0
    builds the report (and runs the prediction analysis) from all of them and prints it."""
    import dataclasses

    import torch

    from varbench._util.distributed import each_rank_alone, rank_device, solo
    from varbench.app.validation import run_validation

    cfg = validate_config(args)  # after joining: the default device is the rank's own
    own = rank_device()
    if own is not None and own.type == "cuda" and torch.device(cfg.base["device"]).type == "cuda":
        # every rank trains on its own GPU (train_device); one device name for all, so that
        # every rank's runs have the same case keys (the report finds them all)
        cfg = dataclasses.replace(cfg, base={**cfg.base, "device": "cuda"})
    out = Path(args.out)
    each_rank_alone(lambda r, w: run_validation(cfg, out, progress=None, shard=(r + 1, w)))
    if rank != 0:
        return 0
    report_dir = Path(args.report_dir) if args.report_dir else None
    with solo():  # the report's prediction analysis: rank 0 alone, the others are done
        summary = run_validation(cfg, out, progress=None, report_only=True,
                                 report_dir=report_dir)
    print(summary)
    print(f"report: {(report_dir or out) / 'report.md'}")
    return 0


def register(subparsers) -> None:
    """Add ``train`` and ``validate`` to the ``varbench`` CLI."""
    p = subparsers.add_parser(
        "train", help="train a policy with a GRPO/PPO loop and record every step",
        description="Train a policy (docs/science.md section 7). Flags override --config.",
    )
    p.add_argument("--config", metavar="TOML", help="TrainConfig as TOML (field = value)")
    p.add_argument("--allow-code", action="store_true",
                   help="let the --config file name code: MODULE:ATTR tasks, schemes and "
                   "verifiers, trust_remote_code = true (without it such a file is refused, "
                   "with the list of entries)")
    p.add_argument("--out", required=True, metavar="DIR", help="run directory (records, ckpts)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --out")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in an --out that holds one (the old run is moved to "
                        "OUT.replaced-N, not deleted)")
    add_config_flags(p)
    p.set_defaults(func=_cmd_train)

    v = subparsers.add_parser(
        "validate", help="train schemes x G x seeds and test the OTB claims on held-out accuracy",
        description="The validation experiment (issue 6): schemes x G x seeds to a fixed "
        "sampled-token budget from one warm start; tables + summary in --out.",
    )
    _add_validate_flags(v)
    v.set_defaults(func=_cmd_validate)
