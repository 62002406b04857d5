"""``check_estimator``: the regression test a new advantage estimator must pass.

    from varbench.testing import check_estimator
    result = check_estimator("mypkg.adv:my_estimator")   # or a callable, or a scheme name
    print(result)            # pass/fail table
    assert result.passed

Rows (``result.table``, a DataFrame): the deterministic contract checks of
:mod:`varbench.testing.contract`, the bias tests of :mod:`varbench.testing.bias` against the
exact gradient of an enumerable toy task, and the variance at equal token budget against
baselines. ``required`` rows decide ``passed``; the others are measured and reported.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd

from varbench._util.guard import guarded
from varbench.testing import bias as _bias
from varbench.testing.adapt import load
from varbench.testing.contract import contract_rows
from varbench.testing.toy import ToyPolicy, ToyTask

COLUMNS = ["check", "passed", "required", "value", "se", "debiased", "p_value", "threshold",
           "detail"]


@dataclass
class CheckResult:
    """Outcome of :func:`check_estimator`: ``passed`` and one table row per check."""

    name: str
    shape: str
    passed: bool
    table: pd.DataFrame
    config: dict[str, Any] = field(default_factory=dict)
    wall_time_s: float = 0.0

    def row(self, check: str) -> pd.Series:
        """The table row named ``check`` (e.g. "bias (raw)")."""
        hit = self.table[self.table["check"] == check]
        if hit.empty:
            raise KeyError(f"no check {check!r}; have {list(self.table['check'])}")
        return hit.iloc[0]

    def __str__(self) -> str:
        lines = [f"check_estimator: {self.name} ({self.shape}-shaped), "
                 f"G={self.config.get('G')}, {self.config.get('num_steps')} steps, "
                 f"seed={self.config.get('seed')}, alpha={self.config.get('alpha')}"]
        lines.append(f"{'status':6}  {'check':34} {'value':>10} {'SE':>9} {'p':>8}  detail")
        for r in self.table.itertuples():
            status = ("PASS" if r.passed else "FAIL") if r.required else (
                "info" if r.passed else "warn")
            lines.append(
                f"{status:6}  {r.check:34} {_num(r.value):>10} {_num(r.se):>9} "
                f"{_num(r.p_value):>8}  {r.detail}"
            )
        lines.append(f"{'PASSED' if self.passed else 'FAILED'} in {self.wall_time_s:.1f} s")
        return "\n".join(lines)


def _no_signal(x: Any) -> bool:
    """Estimates [M, D] whose mean is exactly zero (e.g. an all-zero estimator, or a group-mean
    baseline at G = 1, which cancels every reward): no direction to test for bias."""
    return float(x.double().mean(0).norm()) == 0.0


def _degenerate_rows(G: int) -> list[dict]:
    why = ("the estimator's gradient estimates average to exactly zero"
           + (" (at G=1 a group-mean baseline cancels every reward; use G >= 2)" if G == 1
              else " (all-zero advantages?)") + ": no gradient signal, so no bias to measure")
    return [
        {"check": "bias (rescaled)", "passed": False, "required": True, "detail": why},
        {"check": "scale along g*", "value": 0.0, "passed": False, "required": True,
         "detail": "E[g_hat].g* / ||g*||^2 is 0: the estimator does not point along g*"},
    ]


def _num(v: Any) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return f"{v:.3g}"


def check_estimator(
    fn_or_name: Any,
    *,
    G: int = 4,
    num_steps: int = 3000,
    seed: int = 0,
    alpha: float = 1e-3,
    tolerance: float = 0.05,
    baselines: Sequence[str] = ("centered", "otb"),
    require_unbiased: bool = False,
    require_all_agree_zero: bool = True,
    max_variance_ratio: float | None = None,
    task: ToyTask | None = None,
    groups_per_call: int = 256,
    estimator_options: dict[str, Any] | None = None,
    device: str | Any | None = None,
) -> CheckResult:
    """Run every check on an estimator; deterministic for a given ``seed``.

    ``fn_or_name``: a registered scheme name, ``"MODULE:FUNCTION"``, or a callable of any shape
    ``register_scheme`` accepts, adapted by the same
    :func:`~varbench.estimators.adapters.as_scheme`: ``fn(rewards[P,G], mask[P,G,T], opts)``
    (scheme), ``fn(rewards, mask, **options) -> [P,G,T]`` (keywords) or
    ``fn(token_level_rewards[B,T], response_mask[B,T], index[B], **kw) -> (adv, returns)``
    (verl), told apart by signature. The token statistics ``logprobs`` / ``sum_pi_sq`` reach
    estimators that take them (verl: as ``old_log_probs`` / ``sum_pi_squared``);
    ``estimator_options`` are passed on every call (names beyond ``SchemeOptions`` as extra
    options). A callable's raw output is checked (not masked first).

    Bias: ``num_steps`` steps of G responses for each prompt of ``task`` (default
    ``ToyTask()``). A bias test fails when p < ``alpha`` (its false-alarm rate for an estimator
    without that bias) and the debiased relative bias exceeds ``tolerance``. The raw test is
    required only with ``require_unbiased`` (group-mean baselines are unbiased up to the
    positive factor (G-1)/G, which is not a defect); the rescaled test always is.
    Variance: rescaled variance x tokens against each of ``baselines`` on the same groups;
    required only when ``max_variance_ratio`` is given.

    ``device`` (None: the CPU): where the estimators run; their inputs are moved there and an
    output on another device is a failed check (an estimator that drops to the CPU would break
    a GPU training loop). The toy task and the statistics stay on the CPU in float64.

    Data-parallel: under ``torchrun`` (``torch.distributed`` initialised) the sampled steps are
    split across ranks and gathered; every rank returns the single-process result.

    Raises :class:`~varbench.testing.adapt.EstimatorInputError` (a ValueError) for a module
    that cannot be imported, a missing function, a wrong signature or an option the estimator
    cannot take; the estimator's own errors become failed rows, and so does an estimator that
    tries to end the process (``exit()``, ``sys.exit()``, ``os._exit()``: see
    :mod:`varbench._util.guard`). A ``KeyboardInterrupt`` propagates (no verdict: the caller
    reports the check as not finished).
    """
    start = time.perf_counter()
    est, base, cand, rows, dev = _start(
        fn_or_name, G=G, num_steps=num_steps, alpha=alpha, tolerance=tolerance,
        max_variance_ratio=max_variance_ratio, groups_per_call=groups_per_call,
        baselines=baselines, require_all_agree_zero=require_all_agree_zero, seed=seed,
        estimator_options=estimator_options, device=device)
    task = task or ToyTask(seed=seed)
    policy = ToyPolicy(task)
    g_star = policy.exact_gradient()
    calls = {n: on_device(c, dev)  # "": the candidate
             for n, c in {"": cand, **{n: b.call for n, b in base.items()}}.items()}
    xs, tokens = _bias.chunked_estimates(policy, calls, num_steps, G, seed + 1,
                                         groups_per_call=groups_per_call)
    x = xs.pop("")
    rows += _estimate_rows(x, xs, G, lambda e: _bias.bias_rows(e, g_star, alpha=alpha,
                                                              tolerance=tolerance),
                           g_star, tokens, require_unbiased=require_unbiased,
                           max_variance_ratio=max_variance_ratio, where="the toy task")
    table = pd.DataFrame(rows).reindex(columns=COLUMNS)
    passed = bool(table.loc[table["required"], "passed"].all())
    config = {"G": G, "num_steps": num_steps, "seed": seed, "alpha": alpha,
              "tolerance": tolerance, "baselines": list(baselines),
              "require_unbiased": require_unbiased, "max_variance_ratio": max_variance_ratio,
              "task": asdict(task), "groups_per_call": groups_per_call,
              "estimator_options": {k: repr(v) for k, v in (estimator_options or {}).items()},
              "device": str(dev)}
    return CheckResult(est.name, est.shape, passed, table, config,
                       time.perf_counter() - start)


def _start(fn_or_name: Any, *, G: int, num_steps: int, alpha: float, tolerance: float,
           max_variance_ratio: float | None, groups_per_call: int, baselines: Sequence[str],
           require_all_agree_zero: bool, seed: int, estimator_options: dict | None,
           device: Any) -> tuple:
    """The checks of both entry points before any sampling: arguments, the estimator and
    baselines loaded, the contract rows; ``(est, base, guarded candidate, rows, device)``."""
    from varbench._util.bounds import check_knob

    for key, value in (("G", G), ("num_steps", num_steps), ("groups_per_call", groups_per_call),
                       ("alpha", alpha), ("seed", seed),
                       ("tolerance", tolerance)):  # an infinite tolerance would pass any bias
        check_knob(key, value)
    if max_variance_ratio is not None:
        check_knob("max_variance_ratio", max_variance_ratio)
    import torch

    dev = torch.device("cpu") if device is None else torch.device(device)
    est = load(fn_or_name, estimator_options)
    base = {name: load(name) for name in baselines}
    # the candidate runs in a guarded scope: exit() / os._exit() inside it is a failed row,
    # never the end of the process with a status it chose
    cand = guarded(est.call, f"estimator {est.name!r}")
    rows = [dict(r, required=True) for r in contract_rows(on_device(cand, dev), seed)]
    if not require_all_agree_zero:
        for r in rows:
            if r["check"] == "all-agree groups":
                r["required"] = False
    return est, base, cand, rows, dev


def check_estimator_sampled(
    fn_or_name: Any,
    policy: Any,
    task: Any,
    *,
    G: int = 4,
    num_steps: int = 64,
    n_prompts: int = 4,
    n_ref: int = 1024,
    sketch_dim: int | None = 256,
    reward: str | None = None,
    seed: int = 0,
    alpha: float = 1e-3,
    tolerance: float = 0.05,
    baselines: Sequence[str] = ("centered", "otb"),
    require_unbiased: bool = False,
    require_all_agree_zero: bool = True,
    max_variance_ratio: float | None = None,
    estimator_options: dict[str, Any] | None = None,
    device: str | Any | None = None,
) -> CheckResult:
    """:func:`check_estimator` on a real ``policy`` (a :class:`~varbench.models.Policy`) and
    ``task`` (a :class:`~varbench.tasks.Task`): the same contract checks, and the bias and
    variance tests on ``num_steps`` sampled groups of G for each of ``n_prompts`` prompts
    against a reference sampled from ``n_ref`` independent responses per prompt (its noise in
    the tests' null distribution: :mod:`varbench.testing.sampled`); gradients count-sketched
    to ``sketch_dim`` (None: flat). Estimators run on ``device`` (None: the CPU)."""
    from varbench._util.checks import check_positive_int
    from varbench.testing import sampled

    start = time.perf_counter()
    check_positive_int("n_prompts", n_prompts)
    check_positive_int("n_ref", n_ref, minimum=2)
    if sketch_dim is not None:
        check_positive_int("sketch_dim", sketch_dim)
    reward = task.check_reward(reward)
    est, base, cand, rows, dev = _start(
        fn_or_name, G=G, num_steps=num_steps, alpha=alpha, tolerance=tolerance,
        max_variance_ratio=max_variance_ratio, groups_per_call=1, baselines=baselines,
        require_all_agree_zero=require_all_agree_zero, seed=seed,
        estimator_options=estimator_options, device=device)
    calls = {n: on_device(c, dev)  # "": the candidate
             for n, c in {"": cand, **{n: b.call for n, b in base.items()}}.items()}
    xs, ref, tokens = sampled.sampled_estimates(policy, task, calls, G=G, M=num_steps,
                                                n_prompts=n_prompts, n_ref=n_ref,
                                                seed=seed + 1, reward=reward,
                                                sketch_dim=sketch_dim)
    x = xs.pop("")
    where = f"task {task.name!r}"
    if float(ref.mean(0).norm()) == 0:  # every reference reward equal: nothing to test along
        rows.append({"check": "bias (rescaled)", "passed": False, "required": True,
                     "detail": f"the sampled reference gradient is exactly 0 on {where} (every "
                     f"one of its {n_ref} responses per prompt scored the same): no gradient "
                     "signal to test against; use a policy that sometimes succeeds (e.g. "
                     "warm-started), a shaped reward or another verifier"})
    else:
        rows += _estimate_rows(x, xs, G, lambda e: sampled.sampled_bias_rows(
            e, ref, alpha=alpha, tolerance=tolerance), ref.mean(0), tokens,
            require_unbiased=require_unbiased, max_variance_ratio=max_variance_ratio,
            where=where)
    table = pd.DataFrame(rows).reindex(columns=COLUMNS)
    passed = bool(table.loc[table["required"], "passed"].all())
    config = {"G": G, "num_steps": num_steps, "seed": seed, "alpha": alpha,
              "tolerance": tolerance, "baselines": list(baselines),
              "require_unbiased": require_unbiased, "max_variance_ratio": max_variance_ratio,
              "policy": policy.name, "task": task.name, "knobs": dict(task.knobs),
              "reward": reward, "n_prompts": n_prompts, "n_ref": n_ref,
              "sketch_dim": sketch_dim,
              "estimator_options": {k: repr(v) for k, v in (estimator_options or {}).items()},
              "device": str(dev)}
    return CheckResult(est.name, est.shape, passed, table, config,
                       time.perf_counter() - start)


def _estimate_rows(x: Any, xs: dict[str, Any], G: int, bias: Any, g_star: Any, tokens: float,
                   *, require_unbiased: bool, max_variance_ratio: float | None,
                   where: str) -> list[dict]:
    """The bias and variance rows from the candidate's estimates ``x`` (or its error text)
    and the baselines' ``xs`` on the same groups; ``bias(x)`` gives the bias rows."""
    for n, e in xs.items():
        if isinstance(e, str):
            raise RuntimeError(f"baseline {n!r} failed on {where}: {e}")
    rows: list[dict] = []
    if isinstance(x, str):
        rows.append({"check": "bias (rescaled)", "passed": False, "required": True,
                     "detail": f"estimator failed on {where}: {x}"})
    elif _no_signal(x):
        rows.extend(_degenerate_rows(G))
    else:
        for r in bias(x):
            r["required"] = r["check"] != "bias (raw)" or require_unbiased
            rows.append(r)
        flat = {n: e for n, e in xs.items() if _no_signal(e)}
        usable = {n: e for n, e in xs.items() if n not in flat}
        for r in _bias.variance_rows(x, usable, g_star, tokens, max_ratio=max_variance_ratio):
            r["required"] = max_variance_ratio is not None and r["check"].startswith("variance r")
            rows.append(r)
        for n in flat:  # a ratio to a zero-variance, zero-mean baseline is undefined
            rows.append({"check": f"variance ratio vs {n}", "passed": False,
                         "required": max_variance_ratio is not None,
                         "detail": f"baseline {n!r} gives zero gradient estimates at G={G}: "
                         "no comparison"})
    return rows


def on_device(call: Any, device: Any) -> Any:
    """``call(rewards, mask, **stats)`` run with its tensors moved to ``device``, its output
    checked to be there and handed back on the CPU (the identity on the CPU)."""
    import torch

    if device.type == "cpu":
        return call

    def run(rewards: torch.Tensor, mask: torch.Tensor, **stats: Any) -> Any:
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in stats.items()}
        out = call(rewards.to(device), mask.to(device), **moved)
        if isinstance(out, torch.Tensor):
            if out.device.type != device.type:
                raise ValueError(f"estimator returned a tensor on {out.device} for inputs on "
                                 f"{device}: it makes tensors without the inputs' device")
            out = out.cpu()
        return out

    return run
