"""Case kinds a suite may name, and how the runner executes each one.

The analysis kinds are the registered ones (:data:`varbench.analysis.kinds.ANALYSES`, read
live): a case's keys are the kind's config fields, its task(s) and the
:class:`~varbench.app.specs.PolicySpec` keys, validated by ``config.from_dict`` and
``PolicySpec.from_dict`` (:func:`split_case`); one executor builds the policies as the kind
lays them out and calls its ``run(policies, tasks, config)``. The other kinds point at one
library function by ``"module:function"``: ``train`` (one training run; keys are
:class:`~varbench.train.config.TrainConfig` fields), ``validate`` (the training validation
experiment; keys are :class:`~varbench.analysis.validate.ValidateConfig` fields plus
``reduced``) and ``check`` (``check_estimator`` on a scheme name or a user's
``MODULE:FUNCTION``; its keys are the function's keyword parameters). Every kind returns a list
of :class:`~varbench.report.result.AnalysisResult` for the report.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from varbench._util.checks import UsageError
from varbench.tasks.verifiers import error_counts

# Parameters the runner fills in (or builds from settings); a suite cannot set them directly.
RUNNER_PARAMS = ("cache_dir", "progress", "config", "policy", "policies", "task", "tasks")
_P = inspect.Parameter


def _setting(name: str, default: Any) -> inspect.Parameter:
    return _P(name, _P.KEYWORD_ONLY, default=default)


def analysis_parameters(kind: Any) -> dict[str, inspect.Parameter]:
    """The suite keys of an analysis kind: its config's fields, its task(s), and the
    :class:`~varbench.app.specs.PolicySpec` keys (the kind's default states)."""
    from dataclasses import MISSING, fields

    from varbench.app.specs import PolicySpec

    out = {}
    for f in fields(kind.config):
        default = f.default
        out[f.name] = _P(f.name, _P.KEYWORD_ONLY, annotation=f.type,
                         default=list(default) if isinstance(default, tuple) else default)
    many = kind.task_key == "tasks"
    out[kind.task_key] = _setting(kind.task_key, list(kind.tasks) if many else kind.tasks[0])
    for f in fields(PolicySpec):
        default = None if f.default is MISSING else f.default  # knobs: a table or nothing
        out[f.name] = _setting(f.name, list(kind.states) if f.name == "states" else default)
    return out


@dataclass(frozen=True)
class CaseKind:
    """One kind of case: the library function it runs and how its output becomes results."""

    name: str
    target: str  # "module:function"
    summary: str
    settings: tuple[tuple[str, Any], ...] = ()  # extra suite keys and their defaults
    analysis: Any = None  # the registered AnalysisKind (varbench.analysis.kinds) of an analysis

    def function(self) -> Callable:
        module, _, attr = self.target.partition(":")
        try:
            mod = importlib.import_module(module)
        except ImportError as err:
            raise UsageError(
                f"case kind {self.name!r} is not available: cannot import {module} ({err})"
            ) from None
        if not hasattr(mod, attr):
            raise UsageError(f"case kind {self.name!r} is not available: {module} has no {attr}")
        return getattr(mod, attr)

    def parameters(self) -> dict[str, inspect.Parameter]:
        """Suite-settable keys of this kind with their defaults, by name."""
        if self.analysis is not None:
            return analysis_parameters(self.analysis)
        if self.name == "train":
            from dataclasses import fields

            from varbench.train.config import TrainConfig

            return {f.name: _setting(f.name, None) for f in fields(TrainConfig)}
        if self.name == "validate":
            from dataclasses import fields

            from varbench.analysis.validate import ValidateConfig

            out = {f.name: _setting(f.name, None) for f in fields(ValidateConfig)}
            out["device"] = _setting("device", None)  # of every run (default: cuda if any)
            return out
        sig = inspect.signature(self.function())
        out = {}
        for i, p in enumerate(sig.parameters.values()):
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in RUNNER_PARAMS:
                continue
            if self.name == "check" and i == 0:
                continue  # fn_or_name: given as the `estimator` key
            out[p.name] = p
        if self.name == "check":
            out["estimator"] = _P("estimator", _P.KEYWORD_ONLY)
        out.update({k: _setting(k, v) for k, v in self.settings})
        return out

    def placement(self, params: dict[str, Any]) -> dict[str, Any]:
        """``{"device": type, "dtype": spec, "threads": n}`` the case computes on (a check: no
        dtype), with the device resolved now (:func:`~varbench.app.specs.resolve_device`):
        part of the case's cache key, since CPU and CUDA generators draw different tokens from
        one seed, and torch's intra-op thread count changes the order of CPU reductions
        (results differ at ~1e-9 between 1 and 2 threads)."""
        import torch

        from varbench.app.specs import resolve_device

        threads = torch.get_num_threads()
        if self.name == "check":  # no model: the estimators run there on toy tensors
            return {"device": resolve_device(params.get("device")).type, "threads": threads}
        if self.name == "validate":
            base = params.get("base") or {}
            device = params.get("device") or base.get("device")
            dtype = base.get("dtype", "float32")
        else:
            device = params.get("device")
            dtype = params.get("dtype", "float32" if self.name == "train" else "auto")
        return {"device": resolve_device(device).type, "dtype": str(dtype), "threads": threads}

    def execute(self, name: str, params: dict[str, Any], work_dir: Path,
                progress: bool | None, *, cache: bool = True) -> list:
        """Run the case; returns AnalysisResult objects.

        ``work_dir`` is the case's private scratch space (analysis cells under ``cells/``,
        a training run under ``run/``); ``cache=False`` keeps no analysis cells (no resume).
        """
        run = _analysis if self.analysis is not None else _EXECUTORS[self.name]
        if self.name == "check" or _world_size() > 1:  # no scratch / torchrun ranks share it
            return run(self, name, dict(params), Path(work_dir), progress, cache)
        from varbench._util.locks import dir_lock

        Path(work_dir).mkdir(parents=True, exist_ok=True)
        with dir_lock(work_dir, what="work directory"):  # one writer of its cells and runs
            return run(self, name, dict(params), Path(work_dir), progress, cache)


def _world_size() -> int:
    from varbench._util.distributed import rank_world

    return rank_world()[1]


_FIXED = {k.name: k for k in (
    CaseKind("train", "varbench.train.loop:train", "one GRPO/PPO training run"),
    CaseKind("validate", "varbench.app.validation:run_validation",
             "the training validation experiment (schemes x G x seeds, claims)"),
    CaseKind("check", "varbench.testing.check:check_estimator",
             "regression checks of an advantage estimator"),
)}


class _Kinds(Mapping):
    """The case kinds: every registered analysis kind (read live from
    :data:`varbench.analysis.kinds.ANALYSES`, so one registered later is a suite kind and a
    subcommand too), then ``train``, ``validate`` and ``check``."""

    def __init__(self) -> None:
        self._made: dict[str, CaseKind] = {}  # by name, rebuilt when the name is re-declared

    def _analyses(self) -> dict[str, Any]:
        from varbench.analysis.kinds import ANALYSES

        return ANALYSES

    def __getitem__(self, name: str) -> CaseKind:
        ak = self._analyses().get(name)
        if ak is None:
            return _FIXED[name]
        made = self._made.get(name)
        if made is None or made.analysis is not ak:
            made = self._made[name] = CaseKind(ak.name, f"{ak.run.__module__}:run",
                                               ak.summary, analysis=ak)
        return made

    def __iter__(self) -> Iterator[str]:
        return iter([*self._analyses(), *_FIXED])

    def __len__(self) -> int:
        return len(self._analyses()) + len(_FIXED)


KINDS: Mapping[str, CaseKind] = _Kinds()


def planned() -> list[str]:
    """The kinds with a cost plan (the analyses)."""
    return [k for k, v in KINDS.items() if v.analysis is not None]


def _ranked_states(spec: str, states, task, seed: int, progress, **policy) -> dict[str, Any]:
    """:func:`~varbench.app.specs.policy_states`, built on every rank of a torchrun group.

    Rank 0 builds first (warm starts are cached), the others then read its cache. Each policy
    is built on ``policy["device"]``, resolved by :func:`~varbench.app.specs.resolve_device`
    (one process: cuda when available; under NCCL each rank's own GPU), with any world size.
    """
    from varbench._util.distributed import lead_first
    from varbench.app.specs import policy_states

    with lead_first():
        return policy_states(spec, states, task, seed=seed, progress=progress, **policy)


def register_estimators(params: dict[str, Any]) -> None:
    """Import and register every ``MODULE:FUNCTION`` named under ``scheme``/``schemes``."""
    from varbench._util.imports import is_reference
    from varbench.app.specs import resolve_scheme

    for key in ("scheme", "schemes"):
        values = params.get(key)
        for v in values if isinstance(values, (list, tuple)) else [values]:
            if is_reference(v):
                resolve_scheme(v)


def split_case(kind: CaseKind, params: dict) -> tuple[Any, Any, list[str]]:
    """``(PolicySpec, config, task specs)`` of an analysis case's parameters: the one
    validation of the suite schema and the subcommands (errors name the key)."""
    from varbench.app.specs import PolicySpec

    ak = kind.analysis
    if ak is None:
        raise UsageError(f"case kind {kind.name!r} has no cost plan; kinds with one: "
                         f"{planned()}")
    keys = PolicySpec.keys()
    policy = {k: v for k, v in params.items() if k in keys}
    policy.setdefault("states", list(ak.states))
    raw = params.get(ak.task_key, list(ak.tasks) if ak.task_key == "tasks" else ak.tasks[0])
    specs = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    config = {k: v for k, v in params.items() if k not in keys and k != ak.task_key}
    return (PolicySpec.from_dict(policy, source=f"case {kind.name!r}"),
            ak.config.from_dict(config, source=f"case {kind.name!r}"), specs)


def plan_model(pspec):
    """``() -> (ModelShape, free bytes)`` of a policy spec for the chunk plans, read once: its
    config in its dtype (no weights) and the device's free memory before loading (None where
    not measured, the CPU)."""
    import functools

    @functools.cache
    def model():
        from varbench.app.specs import resolve_device
        from varbench.models.memplan import free_device_bytes
        from varbench.train.policies import model_shape_of

        shape = model_shape_of(pspec.spec, pspec.dtype,
                               trust_remote_code=pspec.trust_remote_code)
        return shape, free_device_bytes(resolve_device(pspec.device))
    return model


def analysis_plan(kind: CaseKind, params: dict, *, tasks: list | None = None,
                  vocab_size: int | None = None, model=None):
    """``(Plan, label)``: what an analysis case will spend (every policy state together), from
    the analysis's own plan function (:mod:`varbench.analysis.plan`). ``tasks``: the resolved
    Task objects (None: resolved here from the case); ``vocab_size``: the policy's output
    vocabulary (None: read from its config, no weights loaded); ``model``: ``() -> (ModelShape,
    free bytes)`` for the chunk plans (None: from the config and the device before loading,
    :func:`plan_model`)."""
    from varbench.app.specs import resolve_task
    from varbench.train.policies import is_checkpoint_dir, vocab_size_of

    pspec, config, specs = split_case(kind, params)
    if tasks is None:
        tasks = [resolve_task(t, pspec.knobs) for t in specs]

    def vocab() -> int:
        return vocab_size if vocab_size is not None else vocab_size_of(
            pspec.spec, trust_remote_code=pspec.trust_remote_code)

    ak = kind.analysis
    plan = (ak.plan(tasks, config, vocab, model or plan_model(pspec)) if ak.plan_model
            else ak.plan(tasks, config, vocab))
    if kind.analysis.policies == "per_task":  # one policy per task (the first state)
        return plan, f"{len(tasks)} task(s)"
    states = ([Path(pspec.spec).name] if is_checkpoint_dir(pspec.spec)
              else [str(s) for s in dict.fromkeys(pspec.states)])
    label = f"{len(states)} polic{'y' if len(states) == 1 else 'ies'}: {', '.join(states)}"
    return plan.times(len(states)), label


def _notice(name: str, plan, label: str, *, again: bool = False) -> None:
    """The cost notice on stderr (before any work; ``again``: sizes changed once the policy
    was built, e.g. task tokens added to its vocabulary)."""
    import sys

    from varbench._util.distributed import rank_world

    if rank_world()[0] != 0:  # torchrun: the plan covers every rank's share; said once
        return
    head = "cost, with the policy built" if again else "cost"
    print(f"varbench: case {name!r} {head}: {plan.text(label=label)}", file=sys.stderr,
          flush=True)


def _analysis(kind: CaseKind, name: str, params: dict, work_dir: Path, progress,
              cache: bool) -> list:
    """The one executor of the analysis kinds, for suite cases and subcommands alike: the
    policies as the kind lays them out, then ``run(policies, tasks, config)``."""
    from varbench.app.specs import resolve_device, resolve_task

    ak = kind.analysis
    register_estimators(params)
    pspec, config, specs = split_case(kind, params)
    tasks = [resolve_task(t, pspec.knobs) for t in specs]
    model = plan_model(pspec)  # measured before loading: the second plan reads the same
    plan, label = analysis_plan(kind, params, tasks=tasks, model=model)
    _notice(name, plan, label)  # before any policy is built or warm-started
    device = resolve_device(pspec.device)  # "": cuda when available, else cpu
    policy_kw = {"dtype": pspec.dtype, "device": device,
                 "trust_remote_code": pspec.trust_remote_code,
                 "add_task_tokens": pspec.add_task_tokens}
    settings = pspec.settings(device)
    settings["task_fingerprints"] = [t.fingerprint() for t in tasks]  # a data file's hash
    seed = getattr(config, "seed", 0)
    if ak.policies == "per_task":
        pols = {t.name: next(iter(_ranked_states(pspec.spec, pspec.states, t, seed, progress,
                                                 **policy_kw).values()))
                for t in tasks}
    else:
        pols = _ranked_states(pspec.spec, pspec.states, tasks[0], seed, progress, **policy_kw)
        # the vocabulary as built (task tokens may have grown it): the notice again if it moved
        V = {int(p.model.get_output_embeddings().weight.shape[0]) for p in pols.values()}
        if len(V) == 1:
            built, _ = analysis_plan(kind, params, tasks=tasks, vocab_size=V.pop(),
                                     model=model)
            if built != plan:
                _notice(name, built, label, again=True)
    settings["model_dtype"] = {k: model_dtype(p) for k, p in pols.items()}  # cell keys
    before = error_counts()
    with batchable_attention(pols) as attention:
        results = ak.run(pols, tasks, config,
                         cache_dir=str(work_dir / "cells") if cache else None,
                         progress=progress, settings=settings)
    for r in results:
        r.name = name if len(results) == 1 else f"{name} ({r.config['state']})"
        _annotate(r, pols, before)
        r.notes = [*list(r.notes or []), *attention]
        r.provenance["attention_switch"] = attention
    return results


@contextlib.contextmanager
def batchable_attention(pols: dict[str, Any]) -> Iterator[list[str]]:
    """Every policy's attention on a kernel with a batched (vmap) backward while inside (on
    CUDA the fused sdpa kernels have none: math SDPA instead; see
    :func:`~varbench.grads.precision.batched_backward_attention`); yields the notes saying
    what was switched, one per distinct switch (empty: nothing needed switching)."""
    from varbench.grads.precision import batched_backward_attention

    with contextlib.ExitStack() as stack:
        notes = [stack.enter_context(batched_backward_attention(p.model)) for p in pols.values()]
        yield list(dict.fromkeys(n for n in notes if n))


def _annotate(res, pols: dict[str, Any], before) -> None:
    """Model dtype and device of every policy into the provenance; verifier failures since
    ``before`` (a snapshot of ``error_counts``) as notes."""
    from varbench.tasks.verifiers import describe_errors

    res.provenance["model_dtype"] = {k: model_dtype(p) for k, p in pols.items()}
    res.provenance["model_device"] = {k: str(p.device) for k, p in pols.items()}
    res.notes = [*list(res.notes or []), *describe_errors(before)]


def model_dtype(policy) -> str:
    """``"bfloat16"`` etc.: the dtype of the policy's parameters."""
    return str(next(policy.model.parameters()).dtype).removeprefix("torch.")


def _train(kind: CaseKind, name: str, params: dict, work_dir: Path, progress,
           cache: bool) -> list:
    from varbench.app.specs import resolve_device
    from varbench.report import provenance
    from varbench.report.result import AnalysisResult, Headline
    from varbench.tasks.verifiers import describe_errors
    from varbench.train.config import TrainConfig
    from varbench.train.loop import train

    register_estimators(params)
    params["device"] = str(resolve_device(params.get("device")))  # default: cuda if available
    config = TrainConfig.from_dict(params, source=f"case {name!r}")
    start = time.perf_counter()
    before = error_counts()
    res = train(config, run_dir=work_dir / "run", resume=True, progress=progress)
    df = res.records
    heads = []
    evals = df.dropna(subset=["eval/acc_sampled"]) if "eval/acc_sampled" in df else df.iloc[:0]
    if len(evals):
        first, last = evals.iloc[0], evals.iloc[-1]
        for col, what in (("eval/acc_sampled", "sampled"), ("eval/acc_greedy", "greedy")):
            if col in evals:
                heads.append(Headline(
                    f"final_{what}_accuracy", float(last[col]), None,
                    f"{name}: held-out {what} accuracy {float(first[col]):.3g} -> "
                    f"{float(last[col]):.3g} after {int(last.get('step', len(df) - 1))} steps",
                ))
    if "tokens/sampled" in df:
        heads.append(Headline("tokens_sampled", float(df["tokens/sampled"].iloc[-1]), None,
                              f"{name}: {int(df['tokens/sampled'].iloc[-1])} sampled tokens"))
    prov = provenance(config=config.to_dict(), seeds=config.seed, device=str(res.policy.device),
                      wall_time_s=time.perf_counter() - start,
                      model_dtype=model_dtype(res.policy))
    prov["model_device"] = str(res.policy.device)
    return [AnalysisResult("train", name, {"steps": df}, {"stopped": res.stopped}, heads,
                           config.to_dict(), prov, describe_errors(before))]


def _check(kind: CaseKind, name: str, params: dict, work_dir: Path, progress,
           cache: bool) -> list:
    from varbench.app.specs import resolve_device
    from varbench.report import provenance
    from varbench.report.result import AnalysisResult, Headline
    from varbench.testing.check import check_estimator

    estimator = params.pop("estimator")
    params["device"] = str(resolve_device(params.get("device")))  # default: cuda if available
    res = check_estimator(estimator, **params)
    heads = [Headline("passed", float(res.passed), None,
                      f"{res.name}: {'PASSED' if res.passed else 'FAILED'} check_estimator")]
    for r in res.table.itertuples():
        if r.check.startswith(("bias", "scale", "variance")) and _finite(r.value):
            se = float(r.se) if _finite(r.se) else None
            key = r.check.replace(" ", "_").replace("(", "").replace(")", "").replace("*", "")
            heads.append(Headline(key, float(r.value), se,
                                  f"{res.name}: {r.check} = {r.value:.3g}"
                                  + (f" (SE {se:.2g})" if se is not None else "")))
    prov = provenance(config={"estimator": estimator, **params}, seeds=res.config["seed"],
                      wall_time_s=res.wall_time_s)
    return [AnalysisResult("check", name, {"checks": res.table}, {"passed": res.passed}, heads,
                           res.config, prov, [str(res)])]


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _validate(kind: CaseKind, name: str, params: dict, work_dir: Path, progress,
              cache: bool) -> list:
    """run_validation writes its own report into work_dir; read its records back from there."""
    from varbench.analysis.validate import ValidateConfig
    from varbench.app.specs import resolve_device
    from varbench.app.validation import run_validation

    params = dict(params)
    device = params.pop("device", None)
    cfg = ValidateConfig.from_params(params)
    runs = dict(cfg.base)
    runs["device"] = str(resolve_device(device or runs.get("device")))  # default: cuda if any
    cfg = replace(cfg, base=runs)
    run_validation(cfg, work_dir / "validation", progress=progress)
    return _read_report(work_dir / "validation", name)


def _read_report(out: Path, name: str) -> list:
    """AnalysisResults back from a report directory (summary.json + tables/*.csv)."""
    import json

    import pandas as pd

    from varbench._util.io import inside
    from varbench.report.result import AnalysisResult, Headline

    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    results = []
    for a in summary["analyses"]:
        records = {}
        for rel in a["tables"]:
            if rel.endswith(".csv"):
                records[Path(rel).stem.split("__", 1)[-1]] = pd.read_csv(inside(out, rel))
        heads = [Headline.from_dict(h) for h in a["headlines"]]
        prov = a.get("provenance", {})
        results.append(AnalysisResult(a["kind"], name, records, a.get("summary", {}), heads,
                                      prov.get("config", {}), prov, a.get("notes", [])))
    return results


_EXECUTORS = {"train": _train, "validate": _validate, "check": _check}
