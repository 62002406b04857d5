"""Estimator variance (docs/science.md section 5): variance, bias, MSE, cosine, SNR per scheme x G.

    res = estimator_variance(policy, get_task("sort"), Gs=(2, 4, 8))
    res.records["cells"]    # scheme, G, mode, variance, variance_se, bias, ..., per prompt mean

For each prompt, ``M * max(Gs)`` responses are sampled once; group m of size G is responses
``m*G .. m*G+G-1``. Per-token gradient vectors (exact harness, count-sketched) are computed once
per response and every (scheme, G, mode) estimate ``g_hat_m = sum_{i,t} c_{i,t} v_{i,t}`` is a
contraction of them, with ``c`` the exact loss coefficient at ratio 1 (``token_coefficients``,
sign flipped to the ascent direction). Schemes therefore share their sampled groups: differences
between schemes are paired, and their jackknife SEs (``paired`` records) are small.

Reference g*: ``exact`` enumerates the whole response space (fixed-length tasks with small V**T;
``varbench.analysis.oracle``) and computes g* through the same vectors; ``sampled`` uses an
independent sample with the unbiased raw estimator (its SE reported). Both are the gradient of
J = E[R] (seq-mean-token-sum scale); other modes compare against g* scaled by their constant
(1/L for seq-mean-token-sum-norm; 1/E|o| for token-mean and seq-mean-token-mean, exact only for
fixed-length tasks: for variable lengths these modes estimate a length-weighted objective).

Data-parallel (``torch.distributed``): when a process group is joined (e.g. by
``varbench._util.distributed.init_from_env`` under ``torchrun``), prompt ``p`` is computed by
rank ``p % world_size`` only; its sampling seed depends on the global index ``p`` alone, so the
per-prompt cells do not depend on the world size. The per-prompt records are then exchanged with
``all_gather_object`` and every rank pools the same records, equal to a one-process run with the
same seed (to float tolerance: reductions on different thread counts may round differently).
The same code path runs gloo on CPU and NCCL on GPUs (one GPU per rank)::

    torchrun --standalone --nproc_per_node 2 -m varbench variance --prompts 4 ...
    # GPUs: same command on a machine with CUDA; init_from_env picks NCCL and LOCAL_RANK's GPU

See docs/distributed.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from varbench._util.bounds import check_knob
from varbench._util.checks import UsageError, check_choice
from varbench._util.config import Config, choice, each, knob, text
from varbench._util.distributed import gather_objects, rank_world
from varbench._util.imports import is_reference
from varbench._util.progress import show_progress
from varbench.analysis._common import CellCache, concat, placement_of
from varbench.analysis.kinds import AnalysisKind, one_task, register_analysis
from varbench.analysis.oracle import enumerate_distribution, response_table
from varbench.analysis.plan import Plan, gradient_path, path_memory
from varbench.analysis.variance_cells import (
    GRADIENTS,
    ProjectedContraction,
    _cell,
    _concat_arrays,
    _from_batch,
    _from_sample,
    group_advantages,
    group_coefficients,
    group_estimates,
    headline_pairs,
    table_cells,
)
from varbench.analysis.variance_report import (
    PROXY_MIN_GROUPS,
    PROXY_MIN_RESPONSES,
    headline_vs_centered,
    reads_proxy_weights,
    variance_headlines,
)
from varbench.estimators.aggregation import AGGREGATION_MODES
from varbench.estimators.registry import exact_label, reads, split_label
from varbench.estimators.registry import schemes as registered_schemes
from varbench.grads.exact import token_grad_norms
from varbench.grads.seqnorms import sequence_grad_norms
from varbench.grads.vectors import combine, token_vectors
from varbench.models import memplan
from varbench.models.presets import Policy
from varbench.report.figures import variance_figures
from varbench.report.provenance import provenance
from varbench.report.result import AnalysisResult
from varbench.rollout.external import (
    check_columns,
    rollouts_key,
    rollouts_note,
    variance_rollouts,
)
from varbench.rollout.sampler import sample
from varbench.stats.intervals import INTERVAL_METHODS, planned_groups
from varbench.tasks.base import Task

__all__ = ["DEFAULT_SCHEMES", "GRADIENTS", "VarianceConfig", "estimator_variance",
           "group_advantages", "group_coefficients", "group_estimates", "headline_pairs",
           "table_cells", "variance_plan"]

# Label -> registered scheme; labels ending in "_exact" use exact ||g_t||^2 as OTB weights,
# every other label gets the proxy inputs (logprobs, sum_pi_sq) that OTB-type schemes read.
DEFAULT_SCHEMES: tuple[str, ...] = (
    "raw", "centered", "normalized", "rloo", "topk", "otb", "otb_exact", "otb_loo",
)
DEFAULT_GS: tuple[int, ...] = (2, 4, 8, 16, 32)
_EXACT_LIMIT = 200_000  # largest V**T enumerated for an exact reference
_FLAT_LIMIT = 200_000  # sketch_dim="auto": flat (exact) vectors up to this many parameters


def _reference(policy, task, prompt, p_seed, *, kind, reward, n_ref, vec_kw, progress,
               proj=None, pool=None):
    """(g* [K], se_norm, description) in the sketch space of ``vec_kw`` (per-token vectors)
    or of ``proj`` (a :class:`ProjectedContraction`: one weighted backward per response);
    ``pool``: a rollouts file's responses of the prompt (the sampled reference is its last
    ``n_ref``)."""
    if kind == "exact":
        dist = enumerate_distribution(policy, task, prompt, reward=reward)
        batch, coef = dist.gradient_batch()
        if batch.tokens.shape[1] == 0:
            return None, 0.0, "exact (J = 0: every response scores 0)"
        desc = f"exact enumeration of {dist.responses.shape[0]} responses"
        if proj is not None:  # g* = sum_i c_i grad log pi(y_i): one group of every response
            d = _from_batch(batch, None)
            n = d["mask"].shape[1]
            g = proj.sketch(d["input_ids"][0], d["attention_mask"][0], d["mask"][0],
                            coef.double().cpu(), groups=n)[0, 0]
            return g, 0.0, desc
        tv = token_vectors(policy.model, batch, progress=progress, **vec_kw)
        g = combine(tv.vec.double(), coef.double())[0]  # one prompt: P = 1
        return g, 0.0, desc
    batch = (sample(policy, task, [prompt], n_ref, seed=p_seed + 7919, reward=reward)
             if pool is None else pool.reference(n_ref))
    if proj is not None:  # [N, K] S(R_i sum_t g_t), one weighted backward per response
        d = _from_batch(batch, None)
        c = d["rewards"].double()[0, :, None] * d["mask"][0].double()
        per = proj.sketch(d["input_ids"][0], d["attention_mask"][0], d["mask"][0], c[None],
                          groups=None)[0]
    else:
        tv = token_vectors(policy.model, batch, progress=progress, **vec_kw)
        per = batch.rewards.double()[0, :, None] * tv.vec.double()[0].sum(1)  # R_i sum_t v
    g = per.mean(0)
    se = float(((per - g) ** 2).sum() / (n_ref - 1) / n_ref) ** 0.5
    return g, se, f"sampled: raw estimator over {n_ref} independent responses"


def _targeted(label: str, baseline: str) -> bool:
    """Whether a paired ratio is a headline (variance_report): OTB-type and rloo vs centered,
    and a scheme vs its exact-weights twin."""
    return (baseline == "centered" and headline_vs_centered(label)
            or baseline == exact_label(label))


def _headline_rel_se(data, Gs, M, labels, modes, ref, *, topk_k, max_len, mean_len,
                     contraction=None) -> tuple[float, str]:
    """(largest relative SE, its name) over the figures the headlines report (adaptive M).

    Targeted: each label's projection (with g*) and the headline paired ratios of variance and
    MSE (:func:`_targeted`), all with their jackknife / delta-method SEs on the groups of
    ``M * max(Gs)`` responses. Not targeted: the unpaired budget rows and the variance and
    MSE cells themselves (they are in the headline text with their intervals).
    """
    worst, name = 0.0, ""
    for G in Gs:
        c, pr = _cell(data, G, _groups(M, G, Gs), labels, modes, ref, topk_k=topk_k,
                      max_len=max_len, mean_len=mean_len, intervals=False,
                      contraction=contraction)
        vals = []
        if ref is not None:
            vals += [(f"projection:{r.scheme}:G={G}:{r.mode}", r.projection_se / abs(r.projection))
                     for r in c.itertuples() if r.scheme != "raw" and r.projection != 0]
        vals += [(f"{r.stat}_ratio:{r.scheme}:{r.baseline}:G={G}:{r.mode}", r.ratio_se / r.ratio)
                 for r in pr.itertuples() if _targeted(r.scheme, r.baseline) and r.ratio > 0]
        for k, v in vals:
            if math.isfinite(v) and v > worst:
                worst, name = float(v), k
    return worst, name


SKETCH_PROMPT_STRIDE = 7_919
"""Prompt p's CountSketch is seeded ``sketch_seed + SKETCH_PROMPT_STRIDE * p``: independent
sketches, so the pooled SE ``sqrt(sum se^2) / n`` holds for the sketch's error too (one shared
sketch correlates the prompts' errors); prompt 0 keeps ``sketch_seed``."""

PILOT_SEED = 611_953
"""Offset of the adaptive-M pilot's sampling seed (``seed + 1000 p + PILOT_SEED``, a separate
generator for a table): its groups decide M and are never reported."""



def _groups(M: int, G: int, Gs: Sequence[int]) -> int:
    """Groups of size G in the ``M * max(Gs)`` responses of a prompt: every response is used
    at every G (disjoint groups of i.i.d. draws are i.i.d. groups), so smaller G get more."""
    return M * max(Gs) // G


@dataclass(frozen=True)
class VarianceSizes:
    """The sizes :func:`estimator_variance` runs on, decided by :func:`variance_plan`."""

    Gs: list[int]
    """Group sizes, sorted, without repeats."""
    M: int
    """Groups per sampling round at the largest G (the step of adaptive M)."""
    min_responses: int
    """Responses per prompt at least (``"auto"`` resolved)."""
    M_floor: int
    """Groups per prompt at the largest G that the floor requires (whole rounds of M)."""
    M_cap: int
    """Adaptive M's largest M (at least ``M_floor``; ``M_floor``: no growth)."""
    reference: str
    """``"exact"`` (enumerated) or ``"sampled"``."""
    table: bool
    """Whether the groups come from an enumerated response table (no sampling)."""
    n_ref: int
    """Responses of the sampled reference (``reference == "sampled"``)."""
    space: int
    """Responses of the enumerated space ``V**T`` (0 unless the reference is exact)."""
    n_prompts: int
    """Prompts."""
    target_rel_se: float | None = None
    """Adaptive M's target (None: M stays at the floor)."""
    details: tuple[str, ...] = ()
    """Why the sizes are what they are (a raised floor, the reference chosen)."""

    path: str = "vectors"
    """The gradient path of the group estimates (:func:`~varbench.analysis.plan.gradient_path`)."""
    sets: int = 1
    """Coefficient sets per response and G: schemes x modes."""
    token_sq: bool = False
    """Whether a label reads exact ``||g_t||^2`` (the per-token norm harness on every response
    of the projected path)."""
    memory: memplan.Plan | None = None
    """The path's chunk plan (None: no model shape given to :func:`sizes`)."""

    @property
    def pilot(self) -> int:
        """Groups of adaptive M's pilot round at the largest G (``M``; 0 when M cannot grow)."""
        return self.M if self.target_rel_se is not None and self.M_cap > self.M_floor else 0

    @property
    def max_groups(self) -> int:
        """Groups per prompt at the largest G that a run can draw: the cap and the pilot with
        a target, else the floor (a rollouts file must hold that many)."""
        return self.M_cap + self.pilot if self.target_rel_se is not None else self.M_floor

    @property
    def groups(self) -> dict[int, int]:
        """``{G: groups per prompt}`` at the floor (every response is used at every G)."""
        return {G: _groups(self.M_floor, G, self.Gs) for G in self.Gs}

    @property
    def plan(self) -> Plan:
        """Responses and passes of the call (all prompts): see :mod:`varbench.analysis.plan`."""
        gmax, P = self.Gs[-1], self.n_prompts
        uses = len(self.Gs) * self.sets  # response-uses per response
        if self.table:  # groups drawn from the enumerated table: vectors of every response
            return Plan("variance", 0, 0, P * self.space, P * self.space, details=self.details,
                        path="vectors", uses=P * self.space * uses, cell_passes=P * self.space,
                        memory=self.memory)
        floor, cap = self.M_floor * gmax, self.M_cap * gmax
        ref = self.n_ref if self.reference == "sampled" else 0
        ref_passes = ref if self.reference == "sampled" else self.space
        if self.path == "projected":
            # per response: one forward per G and one weighted backward per coefficient set
            # (a pass each); the sequence-norm check on round 0: its exact norms and its own
            # sketch (one backward each); the reference one weighted backward per response;
            # exact ||g_t||^2 (a label reading them): the norm harness on every response
            per = uses + (1 if self.token_sq else 0)
            extra = 2 * self.M * gmax + ref_passes
        else:
            # per response one batched per-token backward (its vectors, shared by every set);
            # the sequence-norm check on round 0 (one backward per response); the reference's
            per, extra = 1, self.M * gmax + ref_passes
        grows = self.target_rel_se is not None and cap > floor
        how = ("projected: one forward per G and one weighted backward per coefficient set "
               "and response" if self.path == "projected" else
               "vectors: one batched backward of its T cotangents per response, shared by "
               "every coefficient set")
        pilot = self.pilot * gmax  # adaptive M's pilot round: sampled, contracted, not reported
        floor, cap = floor + pilot, cap + pilot
        return Plan("variance", P * floor, P * ref, P * self.space, P * (floor * per + extra),
                    max_sampled=P * cap if grows else None,
                    max_passes=P * (cap * per + extra) if grows else None,
                    details=(*self.details, how), passes_at_most=self.reference == "exact",
                    path=self.path, uses=P * floor * uses,
                    cell_passes=P * floor * (uses if self.path == "projected" else 1),
                    memory=self.memory)


@dataclass(frozen=True)
class VarianceConfig(Config):
    """The estimator-variance analysis (:func:`run`); library defaults (the command line's are
    smaller: G 2 4 8, M 16, one prompt)."""

    schemes: tuple[str, ...] = each(DEFAULT_SCHEMES)
    """Scheme labels: registered scheme names, ``<scheme>_exact`` for a scheme that reads
    token weights fed exact ||g_t||^2 (``token_weights="exact"``), or MODULE:FUNCTION."""
    Gs: tuple[int, ...] = each(DEFAULT_GS, key="G", minimum=2, flags=("-G",))
    """Group sizes (at least 2); every response is used at every G."""
    modes: tuple[str, ...] = each(("seq-mean-token-sum",), choices=AGGREGATION_MODES)
    """Loss aggregation modes."""
    M: int = knob(32, minimum=3, flags=("-M",))
    """Independent groups per prompt at the largest G (at least 3: an interval needs them);
    the step of adaptive M."""
    M_cap: int | None = knob(None, none=True)
    """Adaptive M: the largest groups per prompt (None: M, no growth); at least M."""
    target_rel_se: float | None = knob(None, none=True)
    """Adaptive M: grow M until every headline figure's relative SE is at most this."""
    min_responses: int | str = knob("auto", auto=True)
    """Responses per prompt at least (M raised in steps of M); ``auto``: max(4096, 1024 x max G)
    when a label reads the proxy weights (1024 groups at every G), else 0."""
    n_prompts: int = knob(2, flags=("--prompts",))
    """Prompts (independent; the pooled SE is over them)."""
    reward: str | None = text(None)
    """Task reward (None: the task's first)."""
    reference: str = choice("auto", ("auto", "exact", "sampled"))
    """g*: ``exact`` (enumerated), ``sampled`` (n_ref responses) or ``auto`` (exact when the
    task is fixed-length with V**T <= 200k)."""
    n_ref: int = knob(2048, minimum=2)
    """Responses of the sampled reference."""
    sketch_dim: int | str | None = knob(1024, auto=True, zero_is_none=True)
    """CountSketch dimension K; 0 (or None): flat vectors, an exact contraction; ``auto``:
    flat up to 200k parameters, else 1024."""
    sketch_seed: int = knob(0)
    """Seed of the count sketch and of the projections, independent of ``seed``."""
    gradients: str = choice("projected", GRADIENTS)
    """Group estimates: ``projected`` (coefficient-first: one weighted backward per response
    and coefficient set, each weight's gradient Kronecker-projected to ``proj_k x proj_k``,
    the small parameters count-sketched to ``sketch_dim``; flat sketch_dim: exact) or
    ``vectors`` (per-token vectors, count-sketched to ``sketch_dim``: the reference path).
    Enumerated tables (exact cells) always use vectors."""
    proj_k: int = knob(16, minimum=1)
    """``gradients="projected"``: each side of a weight's Kronecker projection."""
    exact: str = choice("auto", ("auto", "never"))
    """Exact cells from an enumerated response table (``auto``) or never."""
    table_limit: int = knob(256)
    """Largest enumerated token count for exact cells."""
    interval: str = choice("studentized", INTERVAL_METHODS)
    """Interval method of the Monte Carlo cells."""
    n_boot: int = knob(1000)
    """Bootstrap draws of the intervals."""
    level: float = knob(0.95)
    """Interval level."""
    topk_k: int = knob(1)
    """k of the topk scheme."""
    seed: int = knob(0)
    """Seed of the prompts and samples (prompt p samples with seed + 1000 p)."""
    rollouts: str | None = text(None)
    """Responses sampled elsewhere from this checkpoint (.jsonl / .parquet,
    varbench.rollout.external) instead of sampling: the file's first n_prompts prompts; each
    one's groups are its responses from the first on (disjoint groups of max(G), as the
    sampled rounds), the sampled reference its last n_ref; a prompt needs (M_cap with
    target_rel_se, else the floor's M) x max(G) + n_ref responses. No enumerated table;
    reference auto is then sampled."""
    logprob_tol: float | str = knob("auto", auto=True)
    """Largest mean |behaviour - recomputed| log-prob per token of a rollouts file (auto: by
    the model's dtype, varbench.rollout.external.default_logprob_tol)."""

    def check_together(self) -> None:
        """Labels name registered schemes (``_exact`` only for those reading token weights);
        M_cap at least M."""
        known = registered_schemes()
        for label in self.schemes:
            if is_reference(label):
                continue  # a user's estimator, registered by the caller (as the app does)
            scheme, exact = split_label(label)
            check_choice("schemes", scheme, sorted(known))
            if exact and not exact_label_ok(label):
                raise UsageError(f"schemes={label!r} is not valid: {scheme!r} reads "
                                 "no token weights, so it has no exact-weights variant")
        if self.M_cap is not None:
            check_knob("M_cap", self.M_cap, minimum=self.M)
        if self.rollouts is not None:  # before any model is built
            check_columns(self.rollouts)


def exact_label_ok(label: str) -> bool:
    """Whether ``<scheme>_exact`` names a scheme that reads token weights."""
    return reads(split_label(label)[0], "token_weights")


def variance_plan(task: Task, *, vocab_size: int, shape: memplan.ModelShape | None = None,
                  free: int | None = None, **knobs: Any) -> VarianceSizes:
    """:func:`sizes` of the keyword call (``knobs``: :class:`VarianceConfig` fields)."""
    return sizes(task, VarianceConfig(**knobs), vocab_size, shape=shape, free=free)


def sizes(task: Task, config: VarianceConfig, vocab_size: int, *,
          shape: memplan.ModelShape | None = None, free: int | None = None) -> VarianceSizes:
    """The sizes :func:`run` samples on ``task`` with a policy of ``vocab_size`` output tokens
    (no model, no sampling): the response floor (``min_responses``: M raised to whole rounds of
    ``M``), adaptive M's cap, the reference (exact when enumerable, else ``n_ref`` sampled
    responses), whether groups come from an enumerated table and the gradient path that
    computes the group estimates. ``.plan`` is what it spends. With the model's ``shape`` (and
    ``free``: the device's free bytes before loading, None where not measured) also the path's
    chunk plan over the task's ``max_new_tokens`` positions (a prompt adds its own)."""
    c = config
    schemes, M, target_rel_se, n_prompts = c.schemes, c.M, c.target_rel_se, c.n_prompts
    reference, n_ref, exact, table_limit = c.reference, c.n_ref, c.exact, c.table_limit
    M_cap = M if c.M_cap is None else c.M_cap
    min_responses = c.min_responses
    details = []
    Gs = sorted(set(int(g) for g in c.Gs))
    if min_responses == "auto":
        proxy = [s for s in schemes if reads_proxy_weights(s)]
        # coverage depends on groups, not responses: PROXY_MIN_GROUPS groups at the largest G
        # (smaller G get more, every response being used at every G), and never under the
        # historical response floor
        min_responses = max(PROXY_MIN_RESPONSES, PROXY_MIN_GROUPS * Gs[-1]) if proxy else 0
        if proxy:
            details.append(f"min_responses auto = {min_responses} because {', '.join(proxy)} "
                           f"read(s) the proxy weights: at least {PROXY_MIN_GROUPS} groups at "
                           f"every G (G = {Gs[-1]}: {min_responses // Gs[-1]}), the floor of "
                           "nominal coverage (set --min-responses to change it)")
    V, T = int(vocab_size), int(task.max_new_tokens)
    enumerable = task.fixed_length and V**T <= _EXACT_LIMIT
    if reference == "exact" and not enumerable:
        raise UsageError(
            f"reference='exact' needs a fixed-length task with V**T <= {_EXACT_LIMIT}; task "
            f"{task.name!r} (V={V}, T={task.max_new_tokens}) is not; use reference='sampled'"
        )
    # a rollouts file's responses replace sampling: no table, auto reference from the file
    own = c.rollouts is None
    use_exact = reference == "exact" or (reference == "auto" and enumerable and own)
    use_table = use_exact and exact == "auto" and V**T * T <= table_limit and own
    # the floor: whole rounds of M groups (round 0 stays the historical sample)
    M_floor = M * max(1, -(-min_responses // (M * Gs[-1])))
    if M_floor > M:
        details.append(f"M raised from {M} to {M_floor} (G = {Gs[-1]}: {M_floor * Gs[-1]} "
                       f"responses per prompt) to reach min_responses = {min_responses}")
    details.append(f"reference: exact enumeration of V**T = {V**T} responses per prompt"
                   if use_exact else f"reference: {n_ref} sampled responses per prompt "
                   "(--n-ref)")
    if target_rel_se is not None and max(M_cap, M_floor) > M_floor:
        details.append(f"adaptive M from {M_floor} up to {max(M_cap, M_floor)} "
                       f"(target relative SE {target_rel_se})")
    details += rollouts_note(c.rollouts)
    path = gradient_path(c.gradients, use_table)
    memory = None
    if shape is not None:  # rows of one response_sketches call (a G's floor) or one round
        memory = path_memory(path, shape, (M_floor if path == "projected" else M) * Gs[-1], T,
                             free)
    return VarianceSizes(path=path, sets=len(c.schemes) * len(c.modes),
                         token_sq=any(split_label(label)[1] for label in c.schemes),
                         memory=memory,
                         Gs=Gs, M=M, min_responses=min_responses, M_floor=M_floor,
                         M_cap=max(M_cap, M_floor), reference="exact" if use_exact else "sampled",
                         table=use_table, n_ref=int(n_ref), space=V**T if use_exact else 0,
                         n_prompts=n_prompts, target_rel_se=target_rel_se,
                         details=tuple(details))


def estimator_variance(policy: Policy, task: Task, *, cache_dir: str | None = None,
                       progress: bool | None = None, config: dict[str, Any] | None = None,
                       **knobs: Any) -> AnalysisResult:
    """Variance statistics per scheme x G x mode, averaged over ``n_prompts`` prompts.

    ``knobs``: :class:`VarianceConfig` fields (checked there). A thin wrapper of :func:`run`'s
    per-policy body.

    ``schemes``: labels (registered scheme names, or ``<scheme>_exact`` for OTB-type schemes
    with exact ||g_t||^2 weights). ``reference``: "exact", "sampled" or "auto" (exact when the
    task is fixed-length with V**T <= 200k). Records: ``cells`` (prompt means; SE =
    sqrt(sum se^2) / n_prompts over independent prompts), ``cells_by_prompt``, ``paired``
    (ratio to centered on the same groups, and ``otb`` to ``otb_exact``: what the proxy costs),
    ``reference``. Finished (prompt, G) cells are cached under ``cache_dir`` and skipped.

    Methods per cell (column ``method``): ``exact`` when the prompt's response space is
    enumerated into a table of per-token vectors (``exact="auto"``: exact reference and at
    most ``table_limit`` tokens in the table; ``"never"`` turns it off) and the scheme reads
    rewards only (the estimate is then linear in the responses given the rewards:
    :func:`~varbench.analysis.oracle.exact_moments`); otherwise ``mc`` over M groups, with
    bootstrap-t intervals over groups (``interval``, ``n_boot``, ``level``;
    :mod:`varbench.stats.intervals`). ``M`` groups per prompt at the largest G; a smaller G
    uses the same responses in ``M * max(Gs) // G`` groups. Adaptive M: with
    ``target_rel_se``, a two-stage rule (:func:`~varbench.stats.intervals.planned_groups`): a
    pilot round of ``M`` groups, never reported, gives the largest relative SE of the figures
    the headlines report (projections, paired variance / MSE ratios of OTB-type and rloo vs
    centered and of a scheme vs its ``_exact`` twin), and the reported sample has the whole
    rounds of ``M`` that scale it to the target, pooled over the prompts (each prompt aims at
    ``target * sqrt(n_prompts)``), within [floor, ``M_cap``]; the M used, the reached largest
    relative SE and its figure are in ``reference``, the reached pooled relative SE of every
    headline in the notes. ``min_responses``: at least this many responses per prompt (M
    raised to the smallest multiple of ``M`` with ``M * max(Gs) >= min_responses``, above
    ``M_cap`` if need be); ``"auto"``: ``max(PROXY_MIN_RESPONSES, PROXY_MIN_GROUPS * max(Gs))``
    when a label reads the proxy weights (their intervals undercover with fewer groups), else
    0.
    ``sketch_dim``: K of the CountSketch seeded by ``sketch_seed`` (independent of ``seed``,
    which picks the prompts and samples); None for flat vectors (exact contraction, no sketch
    error); ``"auto"``: flat when the model has at most 200k parameters, else 1024. With a
    sketch, the sketch's own standard deviation is added to the SEs and intervals.

    Under a joined ``torch.distributed`` process group, prompts are sharded over the ranks
    (prompt ``p`` on rank ``p % world_size``) and gathered; every rank returns the full result.
    The gather is a collective: every rank must make the same call.
    """
    return _variance(policy, task, VarianceConfig(**knobs), cache_dir=cache_dir,
                     progress=progress, config=config)


def run(policies: Mapping[str, Policy], tasks: Sequence[Task], config: VarianceConfig, *,
        cache_dir: str | None = None, progress: bool | None = None,
        settings: dict[str, Any] | None = None) -> list[AnalysisResult]:
    """The variance analysis of each policy state on the one task: one result per state
    (``settings`` plus ``state`` identify each one's cells)."""
    if not isinstance(config, VarianceConfig):
        raise UsageError(f"config={config!r} is not valid; expected a VarianceConfig")
    task = one_task(tasks, "variance")
    if not policies:
        raise UsageError("policies is empty; pass a {state: Policy} mapping")
    return [_variance(pol, task, config, cache_dir=cache_dir, progress=progress,
                      config={**(settings or {}), "state": state})
            for state, pol in policies.items()]


def _variance(policy: Policy, task: Task, c: VarianceConfig, *, cache_dir: str | None,
              progress: bool | None, config: dict[str, Any] | None) -> AnalysisResult:
    """One policy's variance analysis (:func:`estimator_variance`)."""
    schemes, modes, M, target_rel_se = list(c.schemes), list(c.modes), c.M, c.target_rel_se
    n_prompts, n_ref, sketch_dim, sketch_seed = c.n_prompts, c.n_ref, c.sketch_dim, c.sketch_seed
    exact, interval, n_boot, level, topk_k, seed = (c.exact, c.interval, c.n_boot, c.level,
                                                    c.topk_k, c.seed)
    gradients, proj_k = c.gradients, c.proj_k
    # exact ||g_t||^2 OTB weights: the per-token norm harness on the projected path (the
    # coefficients are then known: one sketch space for every label), the vectors' own else
    need_tsq = any(split_label(label)[1] for label in schemes)
    reward = task.check_reward(c.reward)
    n_params = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    if sketch_dim == "auto":
        sketch_dim = None if n_params <= _FLAT_LIMIT else 1024
    # the sizes (response floor, adaptive cap, reference) from the one function the cost
    # notice reads too: what it prints is what this run samples
    V = int(policy.model.get_output_embeddings().weight.shape[0])
    plan_sizes = sizes(task, c, V)
    t0 = time.perf_counter()
    Gs, min_responses = plan_sizes.Gs, plan_sizes.min_responses
    M_floor, M_cap = plan_sizes.M_floor, plan_sizes.M_cap
    ref_kind, use_table = plan_sizes.reference, plan_sizes.table
    cfg = {"analysis": "variance", "policy": policy.name, "policy_meta": policy.meta,
           "task": task.name, "knobs": task.knobs, "reward": reward, "schemes": list(schemes),
           "Gs": Gs, "modes": list(modes), "M": M, "M_cap": M_cap,
           "target_rel_se": target_rel_se, "min_responses": min_responses,
           "n_prompts": n_prompts, "reference": ref_kind,
           "n_ref": n_ref, "sketch_dim": sketch_dim, "sketch_seed": sketch_seed,
           "exact": exact, "table": use_table, "interval": interval, "n_boot": n_boot,
           "level": level, "topk_k": topk_k, "seed": seed,
           "gradients": plan_sizes.path, "proj_k": proj_k,
           "groups": "every response at every G", "sketch_seeds": "per prompt",
           **rollouts_key(c.rollouts, c.logprob_tol), **(config or {})}
    cache = CellCache(cache_dir, cfg, placement=placement_of(policy))
    prompts = task.prompts(n_prompts, seed=seed)
    ext, reserve = None, n_ref if ref_kind == "sampled" else 0
    if c.rollouts is not None:
        prompts, ext = variance_rollouts(
            c.rollouts, policy, task, prompts, reward=reward, logprob_tol=c.logprob_tol,
            groups=plan_sizes.max_groups, G=Gs[-1], reserve=reserve,
            exact_reference=ref_kind == "exact")
    show = show_progress(progress)
    max_len = task.max_new_tokens
    rank, world = rank_world()
    mine = [(p, prompt) for p, prompt in enumerate(prompts) if p % world == rank]
    cells, paired, refs = [], [], []
    bar = tqdm(total=len(mine) * len(Gs), desc="variance cells", disable=not show or rank != 0)
    kw = {"labels": schemes, "modes": modes, "topk_k": topk_k, "max_len": max_len}
    for p, prompt in mine:
        names = [f"p{p}_G{G}" for G in Gs]
        done = [(cache.load(n + "_cells"), cache.load(n + "_paired")) for n in names]
        ref_row = cache.load(f"p{p}_reference")
        if ref_row is None or any(c is None or pr is None for c, pr in done):
            p_seed = seed + 1000 * p
            p_sketch = sketch_seed + SKETCH_PROMPT_STRIDE * p
            vec_kw = {"sketch_dim": sketch_dim, "sketch_seed": p_sketch}
            pool = None if ext is None else ext.pool(p, reserve=reserve)
            table = proj = None
            if use_table:
                dist = enumerate_distribution(policy, task, prompt, reward=reward)
                table = response_table(policy, dist, progress=show, **vec_kw)
                g_ref, ref_se = table.reference(), 0.0
                desc = f"exact enumeration of {dist.responses.shape[0]} responses"
                if not bool((table.probs * table.rewards).ne(0).any()):
                    g_ref, desc = None, "exact (J = 0: every response scores 0)"
                gen = torch.Generator().manual_seed(p_seed)
                pilot_gen = torch.Generator().manual_seed(p_seed + PILOT_SEED)

                def draw(m, table=table, gen=gen, pilot_gen=pilot_gen, pilot=False):
                    return table.sample(m * Gs[-1], pilot_gen if pilot else gen)
                sketch_desc, D = table.sketch, table.n_params
            else:
                if gradients == "projected":  # the same projections for g* and every cell
                    flat_k = None if sketch_dim is None else proj_k

                    def new_proj(flat_k=flat_k, p_sketch=p_sketch):
                        return ProjectedContraction(policy.model, k1=flat_k, k2=flat_k,
                                                    k_dense=sketch_dim, seed=p_sketch)
                    proj = new_proj()
                g_ref, ref_se, desc = _reference(policy, task, prompt, p_seed, kind=ref_kind,
                                                 reward=reward, n_ref=n_ref, vec_kw=vec_kw,
                                                 progress=show, proj=proj, pool=pool)
                rounds, first = [0], []

                def draw(m, rounds=rounds, p_seed=p_seed, prompt=prompt, first=first, proj=proj,
                         pool=pool, vec_kw=vec_kw, pilot=False):
                    # round 0 is the historical sample (seed p_seed); later rounds new seeds;
                    # the pilot its own (its groups are never reported)
                    s_ = p_seed + (PILOT_SEED if pilot else 104729 * rounds[0])
                    rounds[0] += not pilot
                    b = (sample(policy, task, [prompt], m * Gs[-1], seed=s_, reward=reward)
                         if pool is None else pool.draw(m * Gs[-1]))
                    if proj is not None:  # no per-token vectors: the arrays go to the host
                        if not first and not pilot:
                            first.append((b, None))
                        return _from_batch(b, _token_sq(policy.model, b) if need_tsq else None)
                    tv = token_vectors(policy.model, b, progress=show, **vec_kw)
                    if not first and not pilot:
                        first.append((b, tv))
                    return _from_sample(b, tv)
                sketch_desc, D = None, n_params
            kw["contraction"] = proj
            # target_met: 1.0 / 0.0, NaN without a target (floats survive the cell cache)
            M_used, rel, met, worst = M_floor, float("nan"), float("nan"), ""
            target_p = None
            if target_rel_se is not None:
                # the target is for the figures pooled over n_prompts independent prompts
                # (SE ~ 1/sqrt(n_prompts) of a prompt's): each prompt aims at target*sqrt(n)
                target_p = target_rel_se * math.sqrt(n_prompts)
            if target_p is not None and M_cap > M_floor:
                # two-stage rule: a pilot round of M groups, never reported, decides M; the
                # reported groups are drawn apart from it, so their intervals keep nominal
                # coverage (stopping on the sample's own SE did not: docs/science.md)
                pilot = draw(M, pilot=True)
                # the same projections, their own cache (the pilot's groups are not data's)
                pilot_kw = dict(kw, contraction=None if proj is None else new_proj())
                r0, _ = _headline_rel_se(pilot, Gs, M, ref=g_ref, mean_len=float(
                    pilot["mask"].sum(-1).double().mean()), **pilot_kw)
                M_used = planned_groups(r0, pilot=M, step=M, floor=M_floor, cap=M_cap,
                                        target=target_p)
                del pilot
            parts = [draw(M)]
            while len(parts) * M < M_used:
                parts.append(draw(M))
            # the sketch checked per prompt on the first round (sampled groups only)
            seq_norms = (_sequence_norms(policy.model, *first[0], proj) if table is None
                         else {"seq_sq_exact": float("nan"), "seq_sq_sketched": float("nan")})
            data = _concat_arrays(parts) if len(parts) > 1 else parts[0]
            parts.clear()  # one copy of the (possibly flat) vectors from here on
            mean_len = float(data["mask"][0, : M_used * Gs[-1]].sum(-1).double().mean())
            if target_p is not None:  # the reached relative SE of the reported groups
                rel, worst = _headline_rel_se(data, Gs, M_used, ref=g_ref, mean_len=mean_len,
                                              **kw)
                met = float(rel <= target_p)
            if sketch_desc is None and proj is not None:
                sketch_desc = ("flat (projected, exact)" if sketch_dim is None
                               else f"projected: {proj.description}")
            if sketch_desc is None:
                sketch_desc = ("flat" if sketch_dim is None or sketch_dim >= D else
                               f"countsketch(K={sketch_dim}, seed={p_sketch})")
            sk = None if sketch_desc == "flat" else sketch_dim
            ref_row = pd.DataFrame([{
                "prompt": p, "prompt_text": prompt.text, "reference": desc,
                "ref_norm": float(g_ref.norm()) if g_ref is not None else 0.0,
                "ref_se_norm": ref_se, "sketch": sketch_desc, "n_params": D,
                "mean_len": mean_len, "mean_reward_sampled":
                    float(data["rewards"][0, : M_used * Gs[-1]].double().mean()),
                "M_used": M_used, "responses": M_used * Gs[-1],
                "min_responses": min_responses, "groups_per_G": " ".join(
                    f"G={G}:{_groups(M_used, G, Gs)}" for G in Gs),
                "target_rel_se": (float("nan") if target_rel_se is None
                                  else float(target_rel_se)),
                "max_rel_se": rel, "max_rel_se_of": worst,
                "target_met": met,
                "table": table is not None, **seq_norms,
            }])
            cache.save(f"p{p}_reference", ref_row)
            for i, G in enumerate(Gs):
                if done[i][0] is None or done[i][1] is None:
                    c, pr = _cell(data, G, _groups(M_used, G, Gs), ref=g_ref,
                                  mean_len=mean_len, table=table,
                                  sketch_k=sk, interval=interval, n_boot=n_boot, level=level,
                                  seed=p_seed, **kw)
                    c.insert(0, "prompt", p)
                    pr.insert(0, "prompt", p)
                    cache.save(names[i] + "_cells", c)
                    cache.save(names[i] + "_paired", pr)
                    done[i] = (c, pr)
                bar.update(1)
        else:
            bar.update(len(Gs))
        refs.append(ref_row)
        cells += [c for c, _ in done]
        paired += [pr for _, pr in done]
    bar.close()
    if world > 1:
        cells, paired, refs = _gather_by_prompt(mine, len(Gs), cells, paired, refs)
    by_prompt, paired_df, ref_df = concat(cells), concat(paired), concat(refs)
    records = {"cells": _pool(by_prompt, ["scheme", "G", "mode"]),
               "paired": _pool(paired_df, ["scheme", "baseline", "G", "mode", "stat"]),
               "cells_by_prompt": by_prompt, "reference": ref_df}
    heads, notes, summary = variance_headlines(records, ref_kind, level)
    wall = time.perf_counter() - t0
    return AnalysisResult(
        kind="variance", name="variance", records=records, summary=summary, headlines=heads,
        config=cfg, notes=notes,
        provenance=provenance(config=cfg, seeds={"prompts": seed, "sample": "seed + 1000 * p",
                                                 "sketch": f"{sketch_seed} + "
                                                           f"{SKETCH_PROMPT_STRIDE} * p"},
                              device=str(policy.device), wall_time_s=wall),
    )


def _sequence_norms(model, batch, tv, proj=None) -> dict[str, float]:
    """Mean per-response ``||sum_t g_t||^2``: exact (a backward per chunk of rows,
    :func:`varbench.grads.sequence_grad_norms`) and through the sketch of ``tv`` or the
    projection of ``proj`` (its expectation over sketches is the exact value: a per-prompt
    check of the sketch)."""
    flat = batch.flat()
    exact = sequence_grad_norms(model, flat.input_ids, flat.response_mask, flat.attention_mask)
    if proj is not None:  # S(sum_t g_t) per response: coefficient 1 on every response token
        d = _from_batch(batch, None)
        m = d["mask"][0].double()
        sketched = proj.sketch(d["input_ids"][0], d["attention_mask"][0], d["mask"][0],
                               m[None], groups=None)[0].pow(2).sum(-1)
    else:
        sketched = tv.vec.sum(2).pow(2).sum(-1)  # [P, G]: ||S sum_t g_t||^2 (0 off the mask)
    return {"seq_sq_exact": float(exact.double().mean()),
            "seq_sq_sketched": float(sketched.double().mean())}


def _token_sq(model, batch) -> torch.Tensor:
    """Exact ``||g_t||^2 [P, G, T]`` of a batch (:func:`token_grad_norms`, no vectors)."""
    flat = batch.flat()
    tok = token_grad_norms(model, flat.input_ids, flat.response_mask, flat.attention_mask,
                           progress=False).token_sq
    return batch.to_groups(tok)


def _gather_by_prompt(mine, n_g, cells, paired, refs):
    """Every rank's per-prompt frames, back in global prompt order (one-process order)."""
    local = [(p, refs[i], cells[i * n_g : (i + 1) * n_g], paired[i * n_g : (i + 1) * n_g])
             for i, (p, _) in enumerate(mine)]
    merged = sorted((x for part in gather_objects(local) for x in part), key=lambda x: x[0])
    return ([c for x in merged for c in x[2]], [pr for x in merged for pr in x[3]],
            [x[1] for x in merged])


def _pool(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Mean over prompts of each value column; SE = sqrt(sum se^2) / n (independent prompts).

    An interval ``[lo, hi]`` around a prompt's value pools the same way, side by side: the
    pooled half-widths are ``sqrt(sum half^2) / n`` (asymmetric intervals stay asymmetric).
    """
    if not len(df):
        return df
    vals = [c for c in df.columns if c not in keys + ["prompt"] and not c.endswith("_se")
            and pd.api.types.is_numeric_dtype(df[c])]
    g = df.groupby(keys, sort=False)
    out = g[vals].mean()
    for c in vals:
        if f"{c}_se" in df:
            out[f"{c}_se"] = g[f"{c}_se"].apply(lambda s: float((s**2).sum() ** 0.5) / len(s))
    for c in vals:
        if c.endswith("_ci_low") or c.endswith("_ci_high"):
            base = c.rsplit("_ci_", 1)[0]
            if base not in df:
                continue
            half = (df[c] - df[base]).abs().groupby([df[k] for k in keys], sort=False)
            sign = -1 if c.endswith("_ci_low") else 1
            out[c] = out[base] + sign * half.apply(lambda s: float((s**2).sum() ** 0.5) / len(s))
    if "method" in df:
        out["method"] = g["method"].agg(lambda s: s.iloc[0] if s.nunique() == 1 else "mixed")
    out["n_prompts"] = g.size()
    return out.reset_index()


def plan(tasks: Sequence[Task], config: VarianceConfig, vocab_size: Callable[[], int],
         model: Callable[[], tuple[memplan.ModelShape, int | None]] | None = None) -> Plan:
    """What :func:`run` spends per policy state (``vocab_size()``: the policy's vocabulary;
    ``model()``: its shape and the device's free bytes, for the chunk plan; None: unstated)."""
    shape, free = (None, None) if model is None else model()
    return sizes(one_task(tasks, "variance"), config, vocab_size(), shape=shape,
                 free=free).plan


KIND = register_analysis(AnalysisKind(
    "variance", VarianceConfig, run, variance_figures, plan,
    "estimator variance, bias, MSE per scheme x G x mode",
    policies="states", tasks=("sort",), states=("warm",),
    cli_defaults={"Gs": (2, 4, 8), "M": 16, "n_prompts": 1, "n_ref": 1024},
    description="Variance, bias, MSE, cosine, SNR of group gradient estimates against an "
                "exact (enumerated) or sampled reference. CLI defaults are smaller than the "
                "library's (G 2 4 8 16 32, M 32, 2 prompts) to run in minutes on 2 cores.",
    plan_model=True))
