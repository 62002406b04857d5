"""varbench measurements over a verl batch: ``DataProto.batch`` (a TensorDict) or a plain dict.

verl 0.9.1's ``DataProto`` imports without GPUs (it needs ray and tensordict installed), but
its trainers do not run on CPU, so this is a function to call from a verl trainer's step (or on
a saved batch), not a hook: ``batch_records(data.batch | {"uid": data.non_tensor_batch["uid"]},
step=...)``. Keys read: ``token_level_rewards`` and ``response_mask`` ``[B, T]``, ``uid``
``[B]`` (group ids, any hashables); ``responses`` ``[B, T]`` (token ids) enables the
cancellation residual; with ``model=`` (the actor, a causal LM) also ``prompts`` ``[B, Lp]``
and ``attention_mask`` ``[B, Lp + T]`` (verl's layout: left-padded prompt, then the response)
enable the split-group variance and the proxy-vs-exact correlation. Rows are regrouped by uid,
one measurement call per distinct group size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from varbench.integrations.measure import measure_groups, records_result

__all__ = ["batch_records", "records_result"]


def batch_records(
    batch: Mapping[str, Any], *, step: int, model: torch.nn.Module | None = None,
    proxy_rows: int = 4, seed: int = 0,
) -> list[dict[str, Any]]:
    """Builder-test counts and (with ``responses``) the cancellation residual of a verl batch;
    with ``model`` also ``grad_var_split`` and ``proxy_exact_corr``.

    Counts are summed over the group sizes present; ``cancellation_residual``,
    ``grad_var_split`` and ``proxy_exact_corr`` are averaged over the sizes, weighted by their
    ``n`` (a group size with fewer than two groups has no split variance).
    """
    for key in ("token_level_rewards", "response_mask", "uid"):
        if key not in batch:
            raise ValueError(f"verl batch has no {key!r}; keys: {sorted(batch)}")
    tok = batch["token_level_rewards"]
    mask = batch["response_mask"]
    ids = batch["uid"]
    ids = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    R = tok.sum(-1)  # verl's outcome: the sum over every position
    responses = batch.get("responses")
    _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
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
            if responses is None or "prompts" not in batch or "attention_mask" not in batch:
                raise ValueError("model= needs the batch's 'prompts', 'responses' and "
                                 f"'attention_mask'; keys: {sorted(batch)}")
            Lp = batch["prompts"].shape[1]
            extra = {"model": model, "prompt_ids": batch["prompts"][rows],
                     "prompt_mask": batch["attention_mask"][rows, :Lp],
                     "proxy_rows": proxy_rows, "seed": seed}
            measures = (*measures, "variance", "proxy")
        for r in measure_groups(step=step, rewards=R[rows], completion_ids=toks,
                                completion_mask=mask[rows], G=int(size), measures=measures,
                                **extra):
            total.setdefault(r["metric"], []).extend([r["value"], r["n"]])
    out = []
    for metric, vals in total.items():
        v, n = np.array(vals[0::2]), np.array(vals[1::2])
        if metric in ("cancellation_residual", "grad_var_split", "proxy_exact_corr"):
            value = float((v * n).sum() / n.sum())
        else:
            value = float(v.sum())
        out.append({"step": int(step), "metric": metric, "value": value, "n": int(n.sum())})
    return out
