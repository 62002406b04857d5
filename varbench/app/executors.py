"""Case kinds a suite may name, and how the runner executes each one.

A kind points at one library function by ``"module:function"``; the suite keys a case may set
are that function's keyword parameters (read from its signature, so the schema cannot drift
from the code), minus the ones the runner supplies itself (cache directory, progress). Every
kind returns a list of :class:`~varbench.report.result.AnalysisResult` for the report.

Kinds: ``proxy``, ``variance``, ``cancellation`` (the analyses; besides the function's keywords
a case sets ``preset``/``checkpoint``, ``states`` (random, warm), ``task`` or ``tasks`` and
``knobs``, from which the runner builds the Policy and Task objects), ``train`` (one training
run; keys are :class:`~varbench.train.config.TrainConfig` fields), ``validate`` (the training
validation experiment; keys are :class:`~varbench.analysis.validate.ValidateConfig` fields plus
``reduced``) and ``check`` (``check_estimator`` on a scheme name or a user's ``MODULE:FUNCTION``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import time
from collections.abc import Callable, Iterator
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


# Settings of the analysis kinds that become Policy / Task objects (as `varbench proxy` etc.
# build them): the model, its states, and the task(s) with their knobs.
_MODEL_SETTINGS = {
    "preset": _setting("preset", "tiny"),  # embedded preset (random init / warm-started)
    "checkpoint": _setting("checkpoint", None),  # a local HF checkpoint dir instead, used as is
    "knobs": _setting("knobs", None),  # task knobs, e.g. { n = 3 }
    "dtype": _setting("dtype", "auto"),  # model dtype: auto (stored) or a torch dtype name
    "device": _setting("device", ""),  # "" (auto: cuda if available, else cpu), cpu, cuda:N
    "trust_remote_code": _setting("trust_remote_code", False),
    "add_task_tokens": _setting("add_task_tokens", False),  # add a toy task's symbols as tokens
}


@dataclass(frozen=True)
class CaseKind:
    """One kind of case: the library function it runs and how its output becomes results."""

    name: str
    target: str  # "module:function"
    summary: str
    settings: tuple[tuple[str, Any], ...] = ()  # extra suite keys and their defaults

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
        else:
            out.update(_MODEL_SETTINGS)
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
        run = _EXECUTORS[self.name]
        if self.name == "check" or _world_size() > 1:  # no scratch / torchrun ranks share it
            return run(self, name, dict(params), Path(work_dir), progress, cache)
        from varbench._util.locks import dir_lock

        Path(work_dir).mkdir(parents=True, exist_ok=True)
        with dir_lock(work_dir, what="work directory"):  # one writer of its cells and runs
            return run(self, name, dict(params), Path(work_dir), progress, cache)


def _world_size() -> int:
    from varbench._util.distributed import rank_world

    return rank_world()[1]


KINDS: dict[str, CaseKind] = {
    k.name: k
    for k in (
        CaseKind("proxy", "varbench.analysis.proxy:proxy_correlation",
                 "proxy w_t / W_t against exact per-token and prefix gradient norms",
                 (("task", "sort"), ("states", ["random", "warm"]))),
        CaseKind("variance", "varbench.analysis.variance:estimator_variance",
                 "estimator variance, bias, MSE per scheme x G x mode",
                 (("task", "sort"), ("states", ["warm"]))),
        CaseKind("cancellation", "varbench.analysis.cancellation:cancellation",
                 "token gradient cancellation at shared steps",
                 (("tasks", ["arith", "toolsum"]), ("states", ["warm"]))),
        CaseKind("train", "varbench.train.loop:train", "one GRPO/PPO training run"),
        CaseKind("validate", "varbench.analysis.validate:run_validation",
                 "the training validation experiment (schemes x G x seeds, claims)"),
        CaseKind("check", "varbench.testing.check:check_estimator",
                 "regression checks of an advantage estimator"),
    )
}


# How each analysis takes its policies: "states" = one call with {state: Policy} side by side,
# "each" = one call (and one result) per state, "per_task" = one call with {task: Policy}.
_POLICY_ARGS = {"proxy": "states", "variance": "each", "cancellation": "per_task"}


def _ranked_states(spec: str, states, task, seed: int, progress, **policy) -> dict[str, Any]:
    """:func:`~varbench.app.specs.policy_states`, built on every rank of a torchrun group.

    Rank 0 builds first (warm starts are cached), the others then read its cache. Each policy
    is built on ``policy["device"]``, resolved by :func:`~varbench.app.specs.resolve_device`
    (one process: cuda when available; under NCCL each rank's own GPU), with any world size.
    """
    import torch.distributed as dist

    from varbench._util.distributed import rank_world
    from varbench.app.specs import policy_states

    rank, world = rank_world()
    if world > 1 and rank != 0:
        dist.barrier()
    out = policy_states(spec, states, task, seed=seed, progress=progress, **policy)
    if world > 1 and rank == 0:
        dist.barrier()
    return out


def register_estimators(params: dict[str, Any]) -> None:
    """Import and register every ``MODULE:FUNCTION`` named under ``scheme``/``schemes``."""
    from varbench._util.imports import is_reference
    from varbench.app.specs import resolve_scheme

    for key in ("scheme", "schemes"):
        values = params.get(key)
        for v in values if isinstance(values, (list, tuple)) else [values]:
            if is_reference(v):
                resolve_scheme(v)


PLANNED = tuple(_POLICY_ARGS)  # the kinds with a cost plan (analysis_plan)


def _analysis_params(kind: CaseKind, params: dict) -> dict:
    """A case's parameters with every default filled in (``sketch_dim = 0``: no sketch)."""
    full = {k: p.default for k, p in kind.parameters().items() if p.default is not _P.empty}
    params = {**full, **params}
    if params.get("sketch_dim") == 0:
        params["sketch_dim"] = None  # TOML has no null: 0 means "no sketch", as on the CLI
    return params


def analysis_plan(kind: CaseKind, params: dict, *, tasks: list | None = None,
                  vocab_size: int | None = None):
    """``(Plan, label)``: what an analysis case will spend (every policy state together), from
    the analysis's own plan function (:mod:`varbench.analysis.plan`). ``tasks``: the resolved
    Task objects (None: resolved here from the case); ``vocab_size``: the policy's output
    vocabulary (None: read from its config, no weights loaded)."""
    from varbench.analysis.cancellation import cancellation_plan
    from varbench.analysis.proxy import proxy_plan
    from varbench.analysis.variance import variance_plan
    from varbench.app.specs import resolve_task
    from varbench.train.policies import is_checkpoint_dir, vocab_size_of

    if kind.name not in PLANNED:
        raise UsageError(f"case kind {kind.name!r} has no cost plan; kinds with one: "
                         f"{list(PLANNED)}")
    p = _analysis_params(kind, params)
    spec = p["checkpoint"] if p["checkpoint"] is not None else p["preset"]
    knobs = p["knobs"] or {}
    if tasks is None:
        specs = p["tasks"] if kind.name == "cancellation" else [p["task"]]
        tasks = [resolve_task(t, knobs) for t in specs]
    if kind.name == "cancellation":  # one policy per task (the first state)
        plan = cancellation_plan(n_tasks=len(tasks), n_prompts=p["n_prompts"], G=p["G"],
                                 inner_steps=p["inner_steps"], sketch_dim=p["sketch_dim"])
        return plan, f"{len(tasks)} task(s)"
    states = ([Path(spec).name] if is_checkpoint_dir(spec)
              else [str(s) for s in dict.fromkeys(p["states"])])
    if kind.name == "proxy":
        plan = proxy_plan(n_prompts=p["n_prompts"], G=p["G"])
    else:
        V = vocab_size if vocab_size is not None else vocab_size_of(
            spec, trust_remote_code=bool(p["trust_remote_code"]))
        keys = inspect.signature(variance_plan).parameters
        plan = variance_plan(tasks[0], vocab_size=V,
                             **{k: v for k, v in p.items() if k in keys and k != "task"}).plan
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
    """The one executor of the analysis kinds, for suite cases and subcommands alike."""
    from varbench.app.specs import resolve_device, resolve_task

    fn = kind.function()
    register_estimators(params)
    params = _analysis_params(kind, params)
    knobs = params["knobs"] or {}
    specs = params["tasks"] if kind.name == "cancellation" else [params["task"]]
    resolved = [resolve_task(t, knobs) for t in specs]
    plan, label = analysis_plan(kind, params, tasks=resolved)
    _notice(name, plan, label)  # before any policy is built or warm-started
    params.pop("knobs")
    preset, checkpoint = params.pop("preset"), params.pop("checkpoint")
    states = params.pop("states")
    spec = checkpoint if checkpoint is not None else preset
    device = resolve_device(params.pop("device"))  # "" / None: cuda when available, else cpu
    policy_kw = {"dtype": params.pop("dtype"), "device": device,
                 "trust_remote_code": params.pop("trust_remote_code"),
                 "add_task_tokens": params.pop("add_task_tokens")}
    # the device type is in the cell keys (CPU and CUDA generators draw apart; cuda:0 and
    # cuda:1 alike, so torchrun ranks agree on them)
    settings = {"preset": preset, "checkpoint": checkpoint, "states": states, "knobs": knobs,
                **policy_kw, "device": device.type}
    run = {"cache_dir": str(work_dir / "cells") if cache else None, "progress": progress,
           "config": settings}
    seed = params.get("seed", 0)
    how = _POLICY_ARGS[kind.name]
    if how == "per_task":
        params.pop("tasks")
        tasks = resolved
        settings["task_fingerprints"] = [t.fingerprint() for t in tasks]
        pols = {t.name: next(iter(_ranked_states(spec, states, t, seed, progress,
                                                 **policy_kw).values()))
                for t in tasks}
        settings["model_dtype"] = {k: model_dtype(p) for k, p in pols.items()}  # cell keys
        before = error_counts()
        with batchable_attention(pols) as attention:
            results = [fn(pols, tasks, **params, **run)]
    else:
        params.pop("task")
        task = resolved[0]
        settings["task_fingerprints"] = [task.fingerprint()]  # a data file's content hash
        pols = _ranked_states(spec, states, task, seed, progress, **policy_kw)
        if kind.name == "variance":  # the vocabulary as built (task tokens may have grown it)
            V = {int(p.model.get_output_embeddings().weight.shape[0]) for p in pols.values()}
            if len(V) == 1:
                built, _ = analysis_plan(kind, {**params, "task": specs[0], "knobs": knobs,
                                                "preset": preset, "checkpoint": checkpoint,
                                                "states": states},
                                         tasks=resolved, vocab_size=V.pop())
                if built != plan:
                    _notice(name, built, label, again=True)
        settings["model_dtype"] = {k: model_dtype(p) for k, p in pols.items()}  # cell keys
        before = error_counts()
        with batchable_attention(pols) as attention:
            if how == "states":
                results = [fn(pols, task, **params, **run)]
            else:
                results = []
                for state, pol in pols.items():
                    res = fn(pol, task, **params,
                             **{**run, "config": {**settings, "state": state}})
                    res.name = f"{name} ({state})" if len(pols) > 1 else name
                    results.append(res)
    for r in results:
        if how != "each":
            r.name = name
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
    from varbench.analysis.validate import ValidateConfig, run_validation
    from varbench.app.specs import resolve_device

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


_EXECUTORS = {"proxy": _analysis, "variance": _analysis, "cancellation": _analysis,
              "train": _train, "validate": _validate, "check": _check}
