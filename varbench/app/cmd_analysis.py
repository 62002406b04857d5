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
            "knobs": parse_knobs(args.knob), **keys}
    return parse_case({k: v for k, v in body.items() if v is not None}, where="command line")


def _parser(f, flag: str):
    """An argparse ``type=`` reading one value of config field ``f`` (an element of a list
    field): an int or float for a numeric field (``auto`` too where it is one), else the
    string. Only the spelling is checked here; the bounds are the config's, as in a suite."""
    import argparse

    meta = f.metadata
    numeric = "knob" in meta and (meta.get("knob") is not None or not meta.get("each"))
    kind = f.type if isinstance(f.type, str) else str(f.type)
    as_float = "float" in kind

    def convert(text: str) -> Any:
        if not numeric:
            return text
        if meta.get("auto") and text == "auto":
            return text
        try:
            return float(text) if as_float else int(text)
        except ValueError:
            what = "a number" if as_float else "an integer"
            raise argparse.ArgumentTypeError(
                f"{flag}={text!r} is not valid; give {what}"
                + (" or 'auto'" if meta.get("auto") else "")) from None

    convert.__name__ = "float" if as_float and numeric else "int" if numeric else "str"
    return convert


def _run_case(kind: str, keys: list[str]):
    """A handler running the case these flags (``keys``: the case keys they set, each its
    flag's dest) describe inside torchrun's process group (one process outside torchrun);
    rank 0 writes the report and prints."""

    def handler(args) -> int:
        from varbench._util.distributed import init_from_env, shutdown
        from varbench.app.executors import KINDS
        from varbench.report import write_report

        vals = {k: getattr(args, k) for k in keys}
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


def add_config_flags(p: argparse.ArgumentParser, kind) -> list[str]:
    """One flag per field of the analysis kind's config (``--n-prompts`` and its declared
    spellings, e.g. ``--prompts``), defaults the kind's command-line ones; returns the case
    keys they set."""
    from dataclasses import fields

    from varbench._util.config import field_docs, flags_of

    docs = field_docs(kind.config)
    keys = []
    for f in fields(kind.config):
        default = kind.cli_defaults.get(f.name, f.default)
        names = flags_of(f)
        shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
        kw: dict[str, Any] = {"dest": f.name, "type": _parser(f, names[-1]),
                              "help": f"{docs.get(f.name, '')} (default: {shown})"
                              .replace("%", "%%")}
        if f.metadata.get("each"):
            kw.update(nargs="+", default=list(default))
        else:
            kw.update(default=default)
        p.add_argument(*names, **kw)
        keys.append(f.name)
    return keys


def register(subparsers) -> None:
    """Add a subcommand per registered analysis kind (``proxy``, ``variance``,
    ``cancellation``) to the ``varbench`` CLI, its flags generated from the kind's config."""
    from varbench.analysis.kinds import ANALYSES

    for kind in sorted(ANALYSES.values(), key=lambda k: _ORDER.get(k.name, len(_ORDER))):
        p = subparsers.add_parser(kind.name, help=kind.summary, description=kind.description)
        if kind.task_key == "tasks":
            p.add_argument("--tasks", "--task", dest="tasks", nargs="+",
                           default=list(kind.tasks),
                           help="tasks (each a name, MODULE:ATTR or data file)")
        else:
            p.add_argument("--task", default=kind.tasks[0], help=_TASK_HELP)
        keys = [kind.task_key, *add_config_flags(p, kind)]
        _common(p, out=f"reports/{kind.name}", states=list(kind.states))
        p.set_defaults(func=_run_case(kind.name, keys))


_ORDER = {"proxy": 0, "variance": 1, "cancellation": 2}  # `varbench --help`'s order
