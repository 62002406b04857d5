"""The registered analysis kinds: each analysis declares itself once, beside its code.

An :class:`AnalysisKind` is ``(name, config class, run, figures)`` plus how its policies are
built (one per state of one task, or one per task), its default task(s) and states, its cost
plan and its command line's defaults. The suite schema, the executors and the command line
read these declarations (:mod:`varbench.app.executors`, :mod:`varbench.app.cmd_analysis`);
none of them knows an analysis by name. A new analysis kind is three places in this package:
its config dataclass and ``run(policies, tasks, config)`` in its module, the
:func:`register_analysis` call beside them, and its import in ``varbench/analysis/__init__.py``
(``tests/test_analysis_kinds.py`` registers one and runs it as a suite case and a command).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from varbench._util.checks import UsageError
from varbench.report.figures import register_figures

POLICY_LAYOUTS = ("states", "per_task")


@dataclass(frozen=True)
class AnalysisKind:
    """One analysis as the application sees it."""

    name: str
    config: type
    """The config dataclass (a :class:`varbench._util.config.Config`): the kind's knobs."""
    run: Callable[..., list]
    """``run(policies, tasks, config, *, cache_dir=None, progress=None, settings=None)`` ->
    list of AnalysisResult; ``settings``: what else identifies the run (cache keys)."""
    figures: Callable[..., list] | None
    """The report's figures of a result (:mod:`varbench.report.figures`)."""
    plan: Callable[..., Any]
    """``plan(tasks, config, vocab_size)`` -> :class:`~varbench.analysis.plan.Plan` of one
    policy (``vocab_size()``: the policy's output vocabulary, read only when needed); with
    ``plan_model``, ``plan(tasks, config, vocab_size, model)``."""
    summary: str
    policies: str = "states"
    """``"states"``: ``{state: Policy}`` of the one task; ``"per_task"``: ``{task: Policy}``."""
    tasks: tuple[str, ...] = ("sort",)
    """Default task spec(s); more than one (the suite key ``tasks``) for a per-task kind."""
    states: tuple[str, ...] = ("warm",)
    """Default preset states."""
    cli_defaults: Mapping[str, Any] = field(default_factory=dict)
    """The subcommand's defaults where they differ from the config's (small, to run in
    minutes on 2 cores)."""
    description: str = ""
    plan_model: bool = False
    """Whether ``plan`` takes a fourth argument ``model()``: the policy's
    :class:`~varbench.models.memplan.ModelShape` and the device's free bytes (its chunk plans)."""

    @property
    def task_key(self) -> str:
        """The suite key and flag of the task(s): ``tasks`` for a per-task kind, else ``task``."""
        return "tasks" if self.policies == "per_task" else "task"


ANALYSES: dict[str, AnalysisKind] = {}


def register_analysis(kind: AnalysisKind) -> AnalysisKind:
    """Declare an analysis kind (once per name); returns it."""
    if kind.name in ANALYSES and ANALYSES[kind.name] is not kind:
        raise UsageError(f"analysis kind {kind.name!r} is already registered")
    if kind.policies not in POLICY_LAYOUTS:
        raise UsageError(f"policies={kind.policies!r} is not valid; choose one of "
                         f"{list(POLICY_LAYOUTS)}")
    if kind.figures is not None:
        register_figures(kind.name, kind.figures)
    ANALYSES[kind.name] = kind
    return kind


def one_task(tasks: Sequence[Any], kind: str) -> Any:
    """The one Task of a ``"states"`` kind; UsageError for none or several."""
    tasks = list(tasks)
    if len(tasks) != 1:
        raise UsageError(f"the {kind} analysis takes one task, got {len(tasks)}")
    return tasks[0]
