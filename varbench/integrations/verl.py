"""varbench measurements of a verl batch: builder-test counts, the cancellation residual, the
split-group variance and proxy fidelity, and verl's own variance proxy against exact norms.

``batch_records(batch, step=...)`` takes what verl's trainer holds after ``compute_advantage``:
a ``DataProto`` (its ``batch`` tensors and ``non_tensor_batch["uid"]``) or a plain mapping of
the same keys. Groups are the ``uid`` values in order of first appearance, so relabelling the
uids changes nothing; the batch's own ``advantages`` are measured when present; the model
attends to what ``attention_mask`` says (tool tokens of a multi-turn batch included) while
only ``response_mask`` tokens are trained.

Inside verl's update, ``varbench_loss(loss_fn)`` wraps the actor's loss function (verl's
``set_loss_fn`` extension point; ``varbench_training_worker()`` is a ``TrainingWorker`` that
wraps whatever loss verl installs, for ``ActorRolloutRefWorker.actor_worker_cls``) and adds
the split-half gradient variance of each micro-batch to verl's metrics under ``varbench/*``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from varbench._util.checks import UsageError
from varbench.integrations.measure import (
    measure_groups,
    records_result,
)

__all__ = ["batch_records", "records_result", "batch_fields", "verl_proxy_records",
           "verl_proxy_rows", "varbench_loss", "varbench_training_worker", "split_halves"]

_WEIGHTED = ("cancellation_residual", "grad_var_split", "proxy_exact_corr",
             "proxy_seq_spearman", "proxy_seq_scale")


def batch_fields(batch: Any) -> dict[str, Any]:
    """The tensors and the ``uid`` of a verl ``DataProto`` (or of a mapping) as one dict."""
    if hasattr(batch, "batch") and hasattr(batch, "non_tensor_batch"):
        td = batch.batch
        out: dict[str, Any] = {k: td[k] for k in td.keys()} if td is not None else {}
        out.update(dict(batch.non_tensor_batch))
        return out
    if isinstance(batch, Mapping):
        return dict(batch)
    raise UsageError(f"batch={type(batch).__name__} is not valid; give a verl DataProto or a "
                     "mapping of its keys")


def _groups(uid: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(inverse, counts)`` with groups numbered in order of first appearance."""
    ids = uid.cpu().numpy() if isinstance(uid, torch.Tensor) else np.asarray(uid)
    _, first, inverse, counts = np.unique(ids, return_index=True, return_inverse=True,
                                          return_counts=True)
    order = np.argsort(first, kind="stable")  # group k of the sorted uids -> appearance rank
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[inverse.reshape(-1)], counts[order]


def batch_records(
    batch: Any, *, step: int, model: torch.nn.Module | None = None,
    proxy_rows: int = 4, seed: int = 0,
) -> list[dict[str, Any]]:
    """Builder-test counts and (with ``responses``) the cancellation residual of a verl batch;
    with ``model`` (the actor) also ``grad_var_split``, ``proxy_seq_*`` and
    ``proxy_exact_corr``.

    ``batch``: a ``DataProto`` or a mapping with ``token_level_rewards``, ``response_mask``
    ``[B, T]`` and ``uid`` ``[B]``; ``advantages`` ``[B, T]`` when present (otherwise rewards
    centred per group); ``prompts``, ``responses`` and ``attention_mask`` ``[B, Lp + T]`` for
    ``model``. Counts are summed over the group sizes present; the other metrics are averaged
    over the sizes, weighted by their ``n``.
    """
    f = batch_fields(batch)
    for key in ("token_level_rewards", "response_mask", "uid"):
        if key not in f:
            raise UsageError(f"verl batch has no {key!r}; keys: {sorted(f)}")
    tok, mask = f["token_level_rewards"], f["response_mask"]
    B, T = mask.shape
    R = tok.sum(-1)  # verl's outcome: the sum over every position
    adv = f.get("advantages")
    if adv is not None and tuple(adv.shape) != (B, T):
        raise UsageError(f"advantages has shape {list(adv.shape)}, expected {[B, T]}")
    responses = f.get("responses")
    inverse, counts = _groups(f["uid"])
    if inverse.shape != (B,):
        raise UsageError(f"uid has {inverse.shape[0]} entries, expected {B}")
    if model is not None:
        missing = [k for k in ("prompts", "responses", "attention_mask") if k not in f]
        if missing:
            raise UsageError(f"model= needs the batch's {missing}; keys: {sorted(f)}")
        Lp = f["prompts"].shape[1]
        if f["attention_mask"].shape[1] != Lp + T:
            raise UsageError(f"attention_mask has {f['attention_mask'].shape[1]} columns, "
                             f"expected prompts + responses = {Lp + T}")
    order = np.argsort(inverse, kind="stable")
    starts = np.cumsum(counts) - counts
    total: dict[str, list[float]] = {}
    for size in np.unique(counts):
        groups = np.nonzero(counts == size)[0]
        rows = torch.as_tensor(order[starts[groups][:, None] + np.arange(size)[None, :]])
        rows = rows.reshape(-1).to(mask.device)
        toks = responses[rows] if responses is not None else torch.zeros_like(mask[rows]).long()
        measures = ("counts", "cancellation") if responses is not None else ("counts",)
        extra: dict[str, Any] = {}
        if model is not None:
            attn = f["attention_mask"][rows]
            extra = {"model": model, "prompt_ids": f["prompts"][rows],
                     "prompt_mask": attn[:, :Lp], "completion_attention": attn[:, Lp:],
                     "proxy_rows": proxy_rows, "seed": seed}
            measures = (*measures, "variance", "proxy_seq", "proxy")
        for r in measure_groups(step=step, rewards=R[rows], completion_ids=toks,
                                completion_mask=mask[rows], G=int(size), measures=measures,
                                advantages=None if adv is None else adv[rows], **extra):
            total.setdefault(r["metric"], []).extend([r["value"], r["n"]])
    out = []
    for metric, vals in total.items():
        v, n = np.array(vals[0::2]), np.array(vals[1::2])
        value = float((v * n).sum() / n.sum()) if metric in _WEIGHTED else float(v.sum())
        out.append({"step": int(step), "metric": metric, "value": value, "n": int(n.sum())})
    return out


def verl_proxy_rows(batch: Any, model: torch.nn.Module, *,
                    gradient_norm: float | None = None) -> dict[str, Any]:
    """verl's ``variance_proxy/*`` metrics of ``batch`` and, per row, verl's proxy and the
    exact norm it stands for: ``{"verl": {...}, "proxy": [B], "exact": [B]}`` (float64, CPU).

    verl's ``proxy2_total_power`` is ``mean_b Abar_b^2 W_b`` (``Abar`` the row's masked mean
    advantage, ``W_b = sum_t (1 - 2 pi_t + sum pi^2)``, clamped at 0); ``exact_b`` is
    ``||sum_t A_{b,t} grad log pi(y_t)||^2`` (ghost norms, one backward). Needs the batch's
    ``old_log_probs``, ``sum_pi_squared``, ``advantages``, ``prompts``, ``responses``,
    ``attention_mask``, ``response_mask`` (the DataProto verl logs the proxy from).
    """
    from verl.trainer.ppo.metric_utils import compute_variance_proxy_metrics

    from varbench.grads.seqnorms import sequence_grad_norms

    f = batch_fields(batch)
    missing = [k for k in ("old_log_probs", "sum_pi_squared", "advantages", "prompts",
                           "responses", "attention_mask", "response_mask") if k not in f]
    if missing:
        raise UsageError(f"verl batch has no {missing}; keys: {sorted(f)}")
    if not hasattr(batch, "batch"):
        raise UsageError("verl_proxy_rows needs the DataProto itself (verl's metric reads it)")
    if "rollout_is_weights" in f:
        raise UsageError("verl_proxy_rows does not handle rollout_is_weights yet (verl's "
                         "off-policy proxy); drop them from the batch to compare on-policy")
    theirs = compute_variance_proxy_metrics(batch, gradient_norm=gradient_norm)
    m = f["response_mask"].double()
    A = f["advantages"].double()
    w = 1 - 2 * f["old_log_probs"].double().exp() + f["sum_pi_squared"].double()
    abar = (A * m).sum(-1) / m.sum(-1).clamp(min=1)
    proxy = (abar ** 2 * (w * m).sum(-1).clamp(min=0)).cpu()
    verl_power = float(theirs["variance_proxy/proxy2_total_power"])
    # the per-row proxy (verl reports only its mean) must reproduce verl's number
    if abs(float(proxy.mean()) - verl_power) > 1e-5 * max(1.0, abs(verl_power)):
        raise RuntimeError(f"per-row proxy mean {float(proxy.mean())!r} differs from verl's "
                           f"proxy2_total_power {verl_power!r}")
    ids = torch.cat([f["prompts"], f["responses"]], 1)
    resp = torch.cat([torch.zeros_like(f["prompts"]), f["response_mask"].long()], 1)
    coef = torch.cat([torch.zeros_like(f["prompts"], dtype=A.dtype), A], 1)
    exact = sequence_grad_norms(model, ids, resp, f["attention_mask"], coefficients=coef)
    return {"verl": theirs, "proxy": proxy.numpy(), "exact": exact.double().cpu().numpy()}


def verl_proxy_records(batch: Any, model: torch.nn.Module, *, step: int,
                       gradient_norm: float | None = None) -> list[dict[str, Any]]:
    """verl's variance proxy beside its exact counterpart (:func:`verl_proxy_rows`) as records:
    ``verl_total_power`` (verl's ``proxy2_total_power``), ``exact_total_power`` (the mean exact
    norm), ``verl_proxy_scale`` (exact / verl) and ``verl_proxy_spearman`` (per-row rank
    correlation of verl's proxy with the exact norm)."""
    from scipy.stats import spearmanr

    r = verl_proxy_rows(batch, model, gradient_norm=gradient_norm)
    p, e = r["proxy"], r["exact"]
    B = len(p)
    verl_power = float(r["verl"]["variance_proxy/proxy2_total_power"])
    out = [
        {"step": step, "metric": "verl_total_power", "value": verl_power, "n": B},
        {"step": step, "metric": "exact_total_power", "value": float(e.mean()), "n": B},
    ]
    if verl_power > 0:
        out.append({"step": step, "metric": "verl_proxy_scale",
                    "value": float(e.mean()) / verl_power, "n": B})
    if np.std(p) > 0 and np.std(e) > 0:
        out.append({"step": step, "metric": "verl_proxy_spearman",
                    "value": float(spearmanr(p, e).statistic), "n": B})
    return out


# ---- inside verl's update: a loss-function wrapper ------------------------------------------


def split_halves(uid: Any) -> tuple[np.ndarray, np.ndarray]:
    """Row masks ``(A, B)`` [rows] of a micro-batch's whole groups: its uids' groups in order of
    first appearance go alternately to A and B; with an odd count the last group is in neither,
    so both halves hold the same number of groups."""
    inverse, counts = _groups(uid)
    n = 2 * (len(counts) // 2)
    return (inverse < n) & (inverse % 2 == 0), (inverse < n) & (inverse % 2 == 1)


def _uids(data: Any) -> list | None:
    try:
        v = data.get("uid", None) if hasattr(data, "get") else None
    except (KeyError, RuntimeError):
        return None
    if v is None:
        return None
    v = v.tolist() if hasattr(v, "tolist") else v
    return [getattr(x, "data", x) for x in v]


def _rows_live(t: Any, keep: torch.Tensor, n_rows: int, offsets: torch.Tensor | None) -> Any:
    """``t`` with the rows outside ``keep`` detached (same values, no gradient through them).
    Rows: a jagged nested tensor's components, a dense tensor's dim 0 of size ``n_rows``, or a
    packed ``(total_nnz, ...)`` tensor cut by ``offsets`` (the micro-batch's sequences)."""
    if not isinstance(t, torch.Tensor) or not t.requires_grad:
        return t
    if t.is_nested:
        vals, off = t.values(), t.offsets()
    elif t.dim() >= 1 and t.shape[0] == n_rows:
        m = keep.to(t.device).view(-1, *([1] * (t.dim() - 1)))
        return torch.where(m, t, t.detach())
    elif offsets is not None and t.dim() >= 1 and t.shape[0] == int(offsets[-1]):
        vals, off = t, offsets.to(t.device)
    else:
        raise ValueError(f"model output of shape {list(t.shape)} has no row layout varbench "
                         f"knows ({n_rows} rows)")
    row = torch.repeat_interleave(torch.arange(len(off) - 1, device=vals.device), off.diff())
    m = keep.to(vals.device)[row].view(-1, *([1] * (vals.dim() - 1)))
    mixed = torch.where(m, vals, vals.detach())
    return torch.nested.nested_tensor_from_jagged(mixed, off) if t.is_nested else mixed


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors ``t``'s graph accumulates gradients into (the parameters the forward
    used: under FSDP2 the unsharded ones), in a fixed order."""
    seen, out, stack = set(), [], [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            out.append(var)
            continue
        stack.extend(g for g, _ in fn.next_functions)
    return out


def _check_every(every: Any) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UsageError(f"every={every!r} is not valid; give an int >= 1")


def varbench_loss(loss_fn: Callable, *, every: int = 1) -> Callable:
    """verl's actor loss function ``loss_fn(model_output, data, dp_group=None) -> (loss,
    metrics)`` that also puts the split-half gradient variance of every ``every``-th call's
    micro-batch into ``metrics``.

    The micro-batch's whole groups (``data["uid"]``) are split in halves A and B
    (:func:`split_halves`); ``L_A`` is ``loss_fn`` with B's rows (and the groups in neither)
    detached in every differentiable model output, ``L_B`` likewise, so ``g_A + g_B`` is the
    gradient of those groups' part of the loss (the chain rule sums over rows, whatever
    ``loss_agg_mode``, clipping, entropy or KL term the loss has) and one extra backward gives
    ``d = grad(L_A - L_B)`` over the parameters the forward used (the trainable ones; under
    FSDP2 their unsharded copies, local to the rank, leaving FSDP's own gradients untouched).
    With groups independent and the halves equal in count, ``E||d||^2 = tr Cov(g_A + g_B)``.
    With ``dp_group``, ranks' ``||d_r||^2`` are summed and divided by ``dp^2`` (FSDP averages
    the ranks' gradients; independent ranks have no cross terms in expectation).

    Metrics (verl ``Metric``s, mean over micro-batches and ranks): ``varbench/grad_var_split``
    (per micro-batch), ``varbench/split_groups`` (groups in A and B, summed over ranks);
    NaN where no rank had two groups. Needs ``uid`` in the micro-batch (verl's trainer passes
    the DataProto's ``non_tensor_batch``); without it nothing is recorded and one warning
    says so. FSDP1 (verl's strategy ``fsdp``) is refused at the first measured micro-batch,
    before any update. Cost per measured micro-batch: two calls of ``loss_fn`` on the same
    outputs and one backward; memory: one gradient of the used parameters; sums in float64.
    """
    from verl.utils.metric.utils import AggregationType, Metric

    _check_every(every)
    state = {"calls": 0, "warned": False}

    def wrapped(*args: Any, **kwargs: Any):
        call = dict(zip(("model_output", "data", "dp_group"), args, strict=False)) | kwargs
        if "model_output" not in call:
            return loss_fn(*args, **kwargs)  # verl's logits-processor call (distillation top-k)
        model_output, data = call.pop("model_output"), call.pop("data", None)
        dp_group = call.pop("dp_group", None)
        kw = call
        loss, metrics = loss_fn(model_output=model_output, data=data, dp_group=dp_group, **kw)
        state["calls"] += 1
        if (state["calls"] - 1) % every or not torch.is_grad_enabled() or not loss.requires_grad:
            return loss, metrics
        uid = _uids(data)
        if uid is None:
            if not state["warned"]:
                warnings.warn("varbench_loss: the micro-batch has no 'uid' (groups unknown); "
                              "no varbench/* metrics are recorded", stacklevel=2)
                state["warned"] = True
            return loss, metrics
        sq, n_groups = _split_sq(loss_fn, model_output, data, dp_group, uid, kw)
        world = 1
        if dp_group is not None and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size(dp_group)
            t = torch.tensor([sq, float(n_groups)], dtype=torch.float64, device=loss.device)
            torch.distributed.all_reduce(t, group=dp_group)
            sq, n_groups = float(t[0]), int(t[1])
        value = sq / world**2 if n_groups >= 2 else float("nan")
        metrics = dict(metrics)
        metrics["varbench/grad_var_split"] = Metric(AggregationType.MEAN, value)
        metrics["varbench/split_groups"] = Metric(AggregationType.MEAN, float(n_groups))
        return loss, metrics

    return wrapped


def _split_sq(loss_fn, model_output, data, dp_group, uid, kw) -> tuple[float, int]:
    """``(||grad(L_A - L_B)||^2, groups in A and B)`` on this rank (float64)."""
    a, b = split_halves(uid)
    n_groups = len(np.unique(np.asarray(uid, dtype=object)[a | b]))
    if n_groups < 2:
        return 0.0, 0
    ids = data.get("input_ids", None) if hasattr(data, "get") else None
    offsets = ids.offsets() if isinstance(ids, torch.Tensor) and ids.is_nested else None
    n_rows = len(uid)

    def half(keep: np.ndarray) -> torch.Tensor:
        k = torch.as_tensor(keep)
        out = {key: _rows_live(v, k, n_rows, offsets) for key, v in model_output.items()}
        return loss_fn(model_output=out, data=data, dp_group=dp_group, **kw)[0]

    diff = half(a) - half(b)
    leaves = [p for p in _leaves(diff) if p.requires_grad]
    if any(getattr(p, "_is_flat_param", False) for p in leaves):  # torch FlatParameter
        # FSDP1 reshards in its gradient hooks: a second backward would free what verl's
        # own backward still needs
        raise UsageError("varbench_loss cannot measure under FSDP1 (FlatParameter, verl's "
                         "strategy 'fsdp'); use actor strategy 'fsdp2'")
    grads = torch.autograd.grad(diff, leaves, retain_graph=True, allow_unused=True)
    sq = math.fsum(float(g.double().pow(2).sum()) for g in grads if g is not None)
    return sq, n_groups


def varbench_training_worker(base: type | None = None, *, every: int = 1) -> type:
    """A verl ``TrainingWorker`` (or ``base``) whose ``set_loss_fn`` wraps the loss verl
    installs in :func:`varbench_loss`: set it as ``ActorRolloutRefWorker.actor_worker_cls`` in
    a subclass to get ``varbench/*`` in the actor's update metrics."""
    from verl.single_controller.base.decorator import Dispatch, register

    if base is None:
        from verl.workers.engine_workers import TrainingWorker as base
    _check_every(every)

    class VarbenchTrainingWorker(base):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def set_loss_fn(self, loss_fn):
            super().set_loss_fn(varbench_loss(loss_fn, every=every))

    return VarbenchTrainingWorker
