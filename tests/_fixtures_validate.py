"""Shared by the validation tests: a tiny grid and stand-ins for training and the variance
analysis (deterministic records, so arms differ and some runs are censored)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch

from varbench.analysis.validate import ValidateConfig


def tiny_grid(**changes) -> ValidateConfig:
    """Random-init micro policy, a few hundred tokens per run: seconds for the whole grid."""
    base = dict(policy="micro", warm_start=False, prompts_per_step=2, lr=1e-3, eval_prompts=4,
                eval_samples=1, agg="token-mean", steps=100_000)
    cfg = ValidateConfig(
        tasks=("sort",), schemes=("normalized", "otb"), Gs=(2, 4), seeds=(0, 1),
        budgets={"sort": 60, "arith": 40, "toolsum_long": 150},
        task_specs={"toolsum_long": {"task": "toolsum", "k": 4}}, eval_responses=4, base=base,
        arms=({"task": "arith", "scheme": "normalized", "G": 2, "variant": "gspo",
               "ratio": "sequence"},
              {"task": "arith", "scheme": "normalized", "G": 2, "variant": "gspo_mr",
               "ratio": "sequence", "transform": "min_replace"},
              {"task": "toolsum_long", "scheme": "otb", "G": 4, "seeds": [0]}),
        claims=({"kind": "tokens", "task": "sort", "a": "otb/4", "b": "normalized/4"},
                {"kind": "compute", "task": "arith", "a": "normalized/2/gspo_mr",
                 "b": "normalized/2/gspo"},
                {"kind": "proxy", "task": "sort", "a": "otb/2", "b": "otb/4"},
                {"kind": "stability", "a": ["otb/4"], "b": ["normalized/2", "normalized/4"]}),
        hacking_rewards=("positional",), hacking_G=2, hacking_seeds=(0,),
        variance_M=3, variance_prompts=1, prediction=True)
    return ValidateConfig(**{**cfg.__dict__, **changes})


def fake_train(tc, run_dir, resume=False, progress=False):
    """Deterministic records of a run: accuracy rises at a speed set by the arm and seed, so
    arms differ and some runs never reach the threshold (censored)."""
    from varbench.train.records import RecordWriter

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    speed = {"otb": 2.0, "normalized": 1.0}.get(tc.scheme, 1.0) * (1 + 0.3 * tc.seed)
    speed *= 1.2 if tc.transform != "none" else 1.0
    per_step = tc.prompts_per_step * tc.G * 3
    w = RecordWriter(Path(run_dir) / "records.csv")
    rows, step, tok = [], 0, 0
    while True:
        acc = min(1.0, 0.2 + speed * tok / (4.0 * tc.token_budget))
        row = {"step": step, "tokens/sampled": tok, "tokens/env": 0, "eval/acc_sampled": acc,
               "eval/acc_greedy": acc, "eval/reward_sampled": acc, "time/wall_s": 0.01 * step
               + 0.001 * tc.G}
        if step:
            row.update({"grad/norm": 1.0 + 0.1 * ((step * 7 + tc.seed) % 5),
                        "policy/entropy": 1.0, "collapse/grad_surge": 0,
                        "collapse/entropy": 0})
        w.write(row)
        rows.append(row)
        if tok >= tc.token_budget:
            break
        step, tok = step + 1, tok + per_step

    return SimpleNamespace(records=pd.DataFrame(rows), stopped="budget",
                           policy=SimpleNamespace(device=torch.device("cpu"),
                                                  model=torch.nn.Linear(1, 1)))


def fake_variance(policy, task, *, schemes, Gs, **kw):
    from varbench.report.result import AnalysisResult

    cells = pd.DataFrame([{"scheme": s, "G": G, "variance": 1.0 / G,
                           "variance_x_tokens": (2.0 if s == "normalized" else 1.0) / G}
                          for s in schemes for G in Gs])
    return AnalysisResult("variance", "v", {"cells": cells}, {}, [], {}, {}, [])


def toml_value(v) -> str:
    """Plain data (str, bool, int, float, list, dict) as a TOML value (inline tables)."""
    import json

    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items()
                                if x is not None) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)  # str, int, float: JSON spells them as TOML does


def write_prereg(path: Path, design: dict, *, analysis: dict | None = None,
                 disclosed: tuple[dict, ...] = ()) -> Path:
    """A pre-registration file registering ``design`` (validate case keys) and ``analysis``
    (default: the analysis the report applies)."""
    from varbench.analysis.validate_prereg import analysis_plan

    lines = ["[registration]", 'suite = "tiny"', 'case = "grid"', 'registered = "2026-12-03"',
             "", "[design]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in design.items() if v is not None]
    lines += ["", "[analysis]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in (analysis or analysis_plan()).items()]
    for d in disclosed:
        lines += ["", "[[disclosed]]"] + [f"{k} = {toml_value(v)}" for k, v in d.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def tiny_design() -> dict:
    """The keys :func:`tiny_grid` sets, as a suite's validate case writes them."""
    from dataclasses import asdict

    cfg, default = asdict(tiny_grid()), asdict(ValidateConfig())
    return {k: v for k, v in cfg.items() if v != default[k]}
