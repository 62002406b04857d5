"""Token gradient cancellation (docs/science.md section 4) on sampled groups.

    res = cancellation(policy, [get_task("arith"), get_task("toolsum")])
    res.records["configs"]   # task, config, full_residual_rel (+ se), shared_residual_rel, ...

For each task one batch is sampled; its advantages (default ``centered``) are fixed. For each
number of PPO inner steps k (a copy of the policy takes k clipped-loss steps on the batch, so
ratios and clips become non-trivial; k = 0 is ratio 1), each aggregation mode, token vs
sequence (GSPO) ratio, and transform (none / Min-Replace / Adv-Orthogonal on the per-sample
weights), the per-token weight ``c`` (without the advantage) is read off the loss's exact
coefficient (``token_coefficients``) and the prefix-trie diagnostics of ``trie.py`` are applied.
Known answers (tests): full-group shared steps cancel exactly under seq-mean-token-sum with
centered advantages and ratio 1; they do not under seq-mean-token-mean with unequal lengths;
both transforms restore ``sum_i A_i v~_i = 0`` at full-group steps.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from varbench._util.bounds import check_knob
from varbench._util.checks import UsageError, check_choice
from varbench._util.config import Config, each, knob, text
from varbench._util.distributed import gather_objects, rank_world
from varbench._util.imports import is_reference
from varbench._util.progress import show_progress
from varbench.analysis._common import CellCache, concat, placement_of
from varbench.analysis.kinds import AnalysisKind, register_analysis
from varbench.analysis.plan import Plan
from varbench.analysis.trie import shared_steps, token_net_weight
from varbench.estimators.aggregation import AGGREGATION_MODES
from varbench.estimators.coefficients import TRANSFORMS, sample_weights
from varbench.estimators.loss import RATIO_KINDS, policy_loss
from varbench.estimators.registry import advantages
from varbench.grads.vectors import token_vectors
from varbench.models.presets import Policy
from varbench.report.figures import cancellation_figures
from varbench.report.headline import fmt, with_se
from varbench.report.provenance import provenance
from varbench.report.result import AnalysisResult, Headline
from varbench.rollout import response_logprobs, sample
from varbench.rollout.external import (
    check_columns,
    rollout_batch,
    rollouts_key,
    rollouts_note,
)
from varbench.tasks.base import Task


def ppo_logps(policy: Policy, batch, adv: torch.Tensor, steps: Sequence[int], *, lr: float,
              clip: tuple[float, float], mode: str = "token-mean") -> dict[int, torch.Tensor]:
    """``{k: logp after k clipped-loss Adam steps}`` of a copy of the policy on ``batch``.

    k = 0 gives the sampling log-probs (ratio 1). The update uses token ratios and ``mode``.
    """
    out = {0: batch.logprobs.detach()}
    if max(steps, default=0) == 0:
        return out
    model = copy.deepcopy(policy.model)
    model.train(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    mask = batch.mask != 0
    with torch.enable_grad():
        for k in range(1, max(steps) + 1):
            logp = response_logprobs(model, batch)
            loss, _ = policy_loss(logp, batch.logprobs, adv, mask, mode, clip=clip)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if k in steps:
                with torch.no_grad():
                    out[k] = response_logprobs(model, batch).detach()
    return out


def _cluster_mean_se(df: pd.DataFrame, col: str) -> tuple[float, float, int]:
    """Mean of ``col`` and its SE treating groups (p) as independent clusters."""
    d = df[["p", col]].dropna()
    if not len(d):
        return float("nan"), float("nan"), 0
    per = d.groupby("p")[col].mean()
    se = float(per.std(ddof=1) / np.sqrt(len(per))) if len(per) > 1 else float("nan")
    return float(d[col].mean()), se, len(d)


def _groups_of(batch, idx: torch.Tensor):
    """The sub-batch of groups ``idx`` (prompt indices) of ``batch``: every [P, ...] field."""
    dev_idx = {}

    def take(x: torch.Tensor) -> torch.Tensor:
        key = x.device
        if key not in dev_idx:
            dev_idx[key] = idx.to(key)
        return x.index_select(0, dev_idx[key])

    keep = idx.tolist()
    return dataclasses.replace(
        batch, **{f: take(getattr(batch, f)) for f in (
            "prompt_ids", "prompt_mask", "tokens", "mask", "env_mask", "logprobs", "sum_pi_sq",
            "entropy", "rewards", "lengths")},
        prompts=[batch.prompts[i] for i in keep] if batch.prompts else [],
        texts=[batch.texts[i] for i in keep] if batch.texts else [])


def _task_records(policy, task, *, n_prompts, G, reward, seed, scheme, modes, ratios, steps,
                  transforms, clip, lr, top_tokens, sketch_dim, progress, rollouts=None,
                  logprob_tol="auto"):
    # Under torchrun every rank samples the same batch (same seed; sampling is cheap) and takes
    # the same PPO inner steps on all of it (one shared policy copy, identical on every rank);
    # the per-token gradient sketches (the expensive part) and the trie diagnostics are
    # computed only for this rank's groups p % world == rank and gathered back in group order.
    rank, world = rank_world()
    if rollouts is None:
        batch = sample(policy, task, task.prompts(n_prompts, seed=seed), G, seed=seed,
                       reward=reward)
    else:
        batch = rollout_batch(rollouts, policy, task, n_prompts, G, seed=seed, reward=reward,
                              logprob_tol=logprob_tol, what="cancellation")
    mask = batch.mask != 0
    rewards = batch.rewards.to(batch.logprobs.dtype)
    adv = advantages(scheme, rewards, mask, logprobs=batch.logprobs, sum_pi_sq=batch.sum_pi_sq)
    logps = ppo_logps(policy, batch, adv, steps, lr=lr, clip=clip)
    mine = torch.arange(rank, batch.P, world, device="cpu")  # host indices (pandas reads them)
    sub = _groups_of(batch, mine) if world > 1 else batch
    grads = None
    if sketch_dim is not None and len(mine):
        grads = token_vectors(policy.model, sub, sketch_dim=sketch_dim, sketch_seed=seed,
                              progress=progress).vec

    def own(x: torch.Tensor) -> torch.Tensor:  # this rank's groups of a [P, G, T] tensor
        return x if world == 1 else x.index_select(0, mine.to(x.device))

    tid = policy.tokenizer.convert_ids_to_tokens
    labels, coefs, local = [], [], []
    for k in steps:
        for mode in modes:
            for ratio in ratios:
                for tf in transforms:
                    c = sample_weights(logps[k], batch.logprobs, adv, mask, mode, ratio=ratio,
                                       clip=clip, transform=tf, max_len=task.max_new_tokens)
                    df = shared_steps(own(batch.tokens), own(adv), own(c), own(mask),
                                      env_mask=own(batch.env_mask),
                                      token_grads=grads if k == 0 else None)
                    df["p"] = mine.numpy()[df["p"].to_numpy()]  # local -> global group index
                    labels.append((k, mode, ratio, tf))
                    coefs.append(c)
                    local.append(df)
    if world > 1:  # one exchange for every configuration; back to one-process (group) order
        parts = gather_objects(local)
        local = [pd.concat([part[j] for part in parts], ignore_index=True)
                 .sort_values("p", kind="stable", ignore_index=True)
                 for j in range(len(labels))]
    confs, nodes, tokens = [], [], []
    for (k, mode, ratio, tf), c, df in zip(labels, coefs, local, strict=True):
        label = f"{mode} | {ratio} ratio | k={k} | {tf}"
        df["abs_weighting_residual"] = df["weighting_residual"].abs()
        meta = {"task": task.name, "config": label, "mode": mode, "ratio": ratio,
                "inner_steps": k, "transform": tf}
        row = dict(meta)
        full = df[df["full_group"]]
        for name, part in (("full", full), ("shared", df)):
            for col, key in (("rel_residual", "residual_rel"),
                             ("weighting_residual", "weighting_rel"),
                             ("abs_weighting_residual", "abs_weighting_rel")):
                v, se, n = _cluster_mean_se(part, col)
                row[f"{name}_{key}"], row[f"{name}_{key}_se"] = v, se
            # Every step counts here, active or not (an all-agree group's steps
            # have A = 0: nothing to cancel, but they did occur).
            row[f"n_{name}"] = int(len(part))
            # Steps with something to cancel (sum |c A| > 0): the means run over
            # these; a zero weight (clipped, or Min-Replace's min of 0) drops out.
            active = part["rel_residual"].notna()
            row[f"n_{name}_active"] = int(active.sum())
            row[f"n_{name}_groups"] = int(part.loc[active, "p"].nunique())
        v, se, _ = _cluster_mean_se(df, "grad_ratio")
        row["grad_ratio"], row["grad_ratio_se"] = v, se
        row["n_grad_steps"] = int(df["grad_ratio"].notna().sum())
        row["n_grad_groups"] = int(df.loc[df["grad_ratio"].notna(), "p"].nunique())
        with torch.no_grad():
            lr_ = (logps[k] - batch.logprobs)[mask]
        row["mean_abs_log_ratio"] = float(lr_.abs().mean())
        confs.append(row)
        nodes.append(df.assign(**meta))
        tw = token_net_weight(batch.tokens, adv, c, mask, top=top_tokens)  # cheap: every rank
        tw.insert(1, "token_str", [str(s) for s in tid(tw["token"].tolist())])
        tokens.append(tw.assign(**meta))
    return pd.DataFrame(confs), concat(nodes), concat(tokens), batch


def _registered() -> list[str]:
    from varbench.estimators.registry import schemes

    return schemes()


@dataclass(frozen=True)
class CancellationConfig(Config):
    """The shared-step cancellation diagnostics (:func:`run`)."""

    n_prompts: int = knob(8, flags=("--prompts",))
    """Prompts sampled per task (seeded)."""
    G: int = knob(8, minimum=2, flags=("-G",))
    """Responses per prompt (at least 2: a shared step needs two responses)."""
    reward: str | None = text(None)
    """Task reward (None: the task's first)."""
    scheme: str = text("centered")
    """Advantage scheme (a registered name, or MODULE:FUNCTION registered by the caller)."""
    modes: tuple[str, ...] = each(AGGREGATION_MODES, choices=AGGREGATION_MODES)
    """Loss aggregation modes compared."""
    ratios: tuple[str, ...] = each(RATIO_KINDS, choices=RATIO_KINDS)
    """Importance ratios compared: token (PPO) and sequence (GSPO)."""
    inner_steps: tuple[int, ...] = each((0, 4), key="inner_steps")
    """PPO inner steps k after which the coefficients are read (0: ratio 1)."""
    transforms: tuple[str, ...] = each(TRANSFORMS, choices=TRANSFORMS)
    """Exchangeability transforms of the per-sample weights compared."""
    clip: tuple[float, float] = each((0.2, 0.2), key="clip_high", length=2)
    """PPO clip epsilons (low, high) of the inner steps and the coefficients."""
    lr: float = knob(3e-3)
    """Adam learning rate of the inner steps."""
    top_tokens: int = knob(15)
    """Most frequent token ids in the ``token_ids`` records."""
    sketch_dim: int | None = knob(256, zero_is_none=True)
    """Gradient sketch dimension of the gradient cancellation ratio (0 or None: no sketch,
    the ratio is then NaN)."""
    seed: int = knob(0)
    """Seed of the prompts, the samples and the sketch."""
    rollouts: str | None = text(None)
    """Responses sampled elsewhere from this checkpoint (.jsonl / .parquet,
    varbench.rollout.external) instead of sampling: the file's first n_prompts prompts x their
    first G responses; one task only."""
    logprob_tol: float | str = knob("auto", auto=True)
    """Largest mean |behaviour - recomputed| log-prob per token of a rollouts file (auto: by
    the model's dtype, varbench.rollout.external.default_logprob_tol)."""

    def check_together(self) -> None:
        """A registered scheme (or MODULE:FUNCTION); clip's low end in [0, 1)."""
        if not is_reference(self.scheme):
            check_choice("scheme", self.scheme, _registered())
        check_knob("clip_low", self.clip[0], arg="clip")
        if self.rollouts is not None:  # before any model is built
            check_columns(self.rollouts)


def plan(tasks: Sequence[Task], config: CancellationConfig, vocab_size=None) -> Plan:
    """What :func:`run` spends on ``tasks``: per task ``n_prompts x G`` responses,
    ``max(inner_steps)`` clipped-loss steps over them (one pass per response each) and, with a
    sketch, one pass per response for the per-token gradient vectors."""
    n_tasks = max(len(tasks), 1)
    n = n_tasks * config.n_prompts * config.G
    k = max(config.inner_steps, default=0)
    grads = config.sketch_dim is not None
    why = [f"{n_tasks} task(s) x {config.n_prompts} prompts x G = {config.G}"]
    if k:
        why.append(f"{k} PPO inner step(s) over each task's batch")
    if grads:
        why.append("per-token gradient sketches of every response")
    why += rollouts_note(config.rollouts)
    return Plan("cancellation", n, passes=n * (k + grads), details=tuple(why))


def run(policies: Mapping[str, Policy], tasks: Sequence[Task], config: CancellationConfig, *,
        cache_dir: str | None = None, progress: bool | None = None,
        settings: dict[str, Any] | None = None) -> list[AnalysisResult]:
    """Shared-step cancellation diagnostics for every configuration on each task, with the
    policy ``policies[task.name]``; one result (records ``configs``, ``nodes``,
    ``token_ids``). ``settings``: what else identifies the run (cache keys, provenance)."""
    if not isinstance(config, CancellationConfig):
        raise UsageError(f"config={config!r} is not valid; expected a CancellationConfig")
    c = config
    if not tasks:
        raise UsageError("tasks is empty; pass at least one Task")
    pols = dict(policies)
    missing = [t.name for t in tasks if t.name not in pols]
    if missing:
        raise UsageError(f"policy has no entry for tasks {missing}; got {sorted(pols)}")
    for t in tasks:  # each task's own reward names (before any work)
        t.check_reward(c.reward)
    if c.rollouts is not None and len(tasks) != 1:
        raise UsageError(f"rollouts={c.rollouts!r} holds one task's responses; got tasks "
                         f"{[t.name for t in tasks]}: pass one task (--tasks NAME)")
    steps = sorted(set(c.inner_steps))
    modes, ratios, transforms = list(c.modes), list(c.ratios), list(c.transforms)
    t0 = time.perf_counter()
    cfg = {"analysis": "cancellation",
           "policies": {k: {"name": v.name, "meta": v.meta} for k, v in pols.items()},
           "tasks": {t.name: t.knobs for t in tasks}, "n_prompts": c.n_prompts, "G": c.G,
           "reward": c.reward, "scheme": c.scheme, "modes": modes, "ratios": ratios,
           "inner_steps": steps, "transforms": transforms, "clip": list(c.clip), "lr": c.lr,
           "top_tokens": c.top_tokens, "sketch_dim": c.sketch_dim, "seed": c.seed,
           **rollouts_key(c.rollouts, c.logprob_tol), **(settings or {})}
    cache = CellCache(cache_dir, cfg, placement=placement_of(pols))
    out: dict[str, list[pd.DataFrame]] = {"configs": [], "nodes": [], "token_ids": []}
    for task in tasks:
        cells = {k: cache.load(f"{task.name}__{k}") for k in out}
        # every rank agrees before any work, so no rank waits alone in a gather
        if any(gather_objects(any(v is None for v in cells.values()))):
            conf, nodes, toks, _ = _task_records(
                pols[task.name], task, n_prompts=c.n_prompts, G=c.G, reward=c.reward,
                seed=c.seed, scheme=c.scheme, modes=modes, ratios=ratios, steps=steps,
                transforms=transforms, clip=tuple(c.clip), lr=c.lr, top_tokens=c.top_tokens,
                sketch_dim=c.sketch_dim, progress=show_progress(progress),
                rollouts=c.rollouts, logprob_tol=c.logprob_tol)
            cells = {"configs": conf, "nodes": nodes, "token_ids": toks}
            if rank_world()[0] == 0:  # every rank holds the gathered cells; one writes them
                for k, v in cells.items():
                    cache.save(f"{task.name}__{k}", v)
        for k, v in cells.items():
            out[k].append(v)
    records = {k: concat(v) for k, v in out.items()}
    heads, notes = _headlines(records["configs"])
    return [AnalysisResult(
        kind="cancellation", name="cancellation", records=records,
        summary={h.key: {"value": h.value, "se": h.se} for h in heads}, headlines=heads,
        config=cfg, notes=notes,
        provenance=provenance(config=cfg, seeds={"prompts": c.seed, "sample": c.seed,
                                                 "sketch": c.seed},
                              device=str(next(iter(pols.values())).device),
                              wall_time_s=time.perf_counter() - t0),
    )]


def cancellation(
    policy: Policy | Mapping[str, Policy],
    tasks: Sequence[Task],
    *,
    cache_dir: str | None = None,
    progress: bool | None = None,
    config: dict[str, Any] | None = None,
    **knobs: Any,
) -> AnalysisResult:
    """Shared-step cancellation diagnostics for every configuration on each task.

    ``policy``: one Policy for every task, or ``{task name: Policy}`` (e.g. a policy
    warm-started on each task); ``knobs``: :class:`CancellationConfig` fields.
    Records: ``configs`` (one row per task x configuration: mean relative residual at
    full-group and at all shared steps, weighting-induced residual, gradient cancellation ratio,
    each with a cluster SE over groups), ``nodes`` (every shared step), ``token_ids`` (net weight
    of the most frequent ids). ``sketch_dim=None`` (or 0) skips per-token gradient vectors (the
    gradient ratio is then NaN). Each task is one cached cell. A thin wrapper of :func:`run`.
    """
    cfg = CancellationConfig(**knobs)
    pols = ({t.name: policy for t in tasks} if isinstance(policy, Policy) else dict(policy))
    return run(pols, tasks, cfg, cache_dir=cache_dir, progress=progress, settings=config)[0]


MIN_STEPS = 10  # a headline resting on fewer active shared steps carries a warning
MIN_GROUPS = 3  # ... or on fewer groups


def _support(n_steps: int, n_groups: int) -> str:
    """'over 12 steps in 3 groups', with a warning below MIN_STEPS / MIN_GROUPS."""
    text = f"over {n_steps} active shared steps in {n_groups} groups"
    if n_steps < MIN_STEPS or n_groups < MIN_GROUPS:
        text += (f" (WARNING: below the minimum of {MIN_STEPS} steps and {MIN_GROUPS} groups; "
                 "not a reliable estimate)")
    return text


def _headlines(conf: pd.DataFrame) -> tuple[list[Headline], list[str]]:
    notes = [
        "Relative residual = |sum_S c_i A_i| / sum_S |c_i A_i| at a shared step S: 0 is exact "
        "cancellation, 1 is none. SEs treat groups as independent clusters.",
        "Headlines report the weighting-induced residual |sum_S (A_i - A_bar)(c_i - c_bar)| / "
        "sum_S |c_i A_i| (the part of the residual the weighting causes: 0 for an exchangeable "
        "weighting whatever the advantages) and the gradient cancellation ratio, each over all "
        "active shared steps, with the number of steps and groups they rest on. The plain "
        "relative residual at partial shared steps mostly measures the advantages (their sum "
        "over a subset is not 0), so it is in the table, not a headline.",
        "At a shared step every member has the same grad log pi(a|h), so the gradient "
        "cancellation ratio equals the scalar relative residual up to the sketch's rounding; "
        "it is computed from per-token gradient sketches at k = 0 only.",
        "Means run over active steps (sum_S |c_i A_i| > 0); a clipped token or a Min-Replace "
        "minimum of 0 removes a step's gradient entirely, which counts as no step here.",
        "PPO inner steps update a copy of the policy with token ratios and token-mean "
        "aggregation; every configuration then reads its coefficients at those parameters.",
        "adv_orthogonal is the definition (one projection per group over its responses); "
        "adv_orthogonal_position is the per-position variant, measured side by side.",
    ]
    heads = []
    for r in conf.itertuples():
        # Headline the ratio-1 comparisons of modes and ratios, and the transforms at k = max.
        key_row = (r.inner_steps == 0 and r.transform == "none") or (
            r.inner_steps == conf["inner_steps"].max() and r.mode == "seq-mean-token-mean")
        if not key_row or r.n_shared_active == 0:
            continue
        heads.append(Headline(
            f"{r.task}:{r.config}:weighting_residual", r.shared_abs_weighting_rel,
            r.shared_abs_weighting_rel_se,
            f"{r.task}, {r.config}: weighting-induced residual "
            f"{with_se(r.shared_abs_weighting_rel, r.shared_abs_weighting_rel_se)} "
            f"{_support(r.n_shared_active, r.n_shared_groups)}; at full-group steps "
            f"{fmt(r.full_abs_weighting_rel)} ({r.n_full_active} active of {r.n_full})."))
        if r.n_grad_steps > 0:
            heads.append(Headline(
                f"{r.task}:{r.config}:grad_ratio", r.grad_ratio, r.grad_ratio_se,
                f"{r.task}, {r.config}: gradient cancellation ratio "
                f"{with_se(r.grad_ratio, r.grad_ratio_se)} "
                f"{_support(r.n_grad_steps, r.n_grad_groups)}."))
    for task, d in conf.groupby("task", sort=False):
        first = d.iloc[0]
        if first["n_full"] == 0:
            notes.append(f"{task}: no full-group shared steps occurred in these samples "
                         "(responses of every group diverge at the first token).")
        else:
            notes.append(f"{task}: {int(first['n_full'])} full-group shared steps occurred, "
                         f"{int(first['n_full_active'])} of them active in the first "
                         "configuration (an all-agree group's steps have A = 0: nothing to "
                         "cancel).")
    return heads, notes


KIND = register_analysis(AnalysisKind(
    "cancellation", CancellationConfig, run, cancellation_figures, plan,
    "token gradient cancellation at shared steps",
    policies="per_task", tasks=("arith", "toolsum"), states=("warm",),
    cli_defaults={"n_prompts": 4, "G": 6, "inner_steps": (0, 3)},
    description="Prefix-trie shared steps: residuals, weighting-induced residuals, gradient "
                "cancellation ratios and per-token net weights across aggregation modes, "
                "token vs sequence ratios, PPO inner steps and restoring transforms."))
