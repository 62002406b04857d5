"""Data-parallel training under torchrun: the pieces :func:`varbench.train.loop.train` adds
when a process group is joined (docs/distributed.md, "Training").

Rank 0 samples, scores and computes the advantages of each step's batch and hands it to every
rank (:func:`share`): the sampler draws one random stream over the whole batch, so a batch
split across ranks would not be the one-process batch. Each rank computes the teacher-forced
log-probs of its own groups ``groups[rank::world]`` only (the expensive part); they are
all-gathered and put back in place (:func:`sharded_logprobs`), so every loss (and every
aggregation denominator) is computed on the full tensor, as in one process. The rank's own
rows keep their graph, the others' are constants: the sum of the ranks' gradients
(:func:`all_reduce_grads`, before clipping) is the one-process gradient up to rounding. Every
rank then takes the same optimizer step on the same parameters; rank 0 evaluates and writes
records and checkpoints. One process (or inside ``distributed.solo()``): every function is
the identity or the plain call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from varbench._util.checks import UsageError
from varbench._util.distributed import broadcast_object, gather_objects, rank_device, rank_world
from varbench.rollout import RolloutBatch, response_logprobs
from varbench.train.config import TrainConfig

_BUCKET = 1 << 25  # elements per all-reduce of flattened gradients (128 MiB in float32)


def train_device(name: str) -> torch.device:
    """The device this rank trains on for ``config.device == name``: ``name`` in one process
    and under gloo; under NCCL the rank's own GPU (``cuda:LOCAL_RANK``) for any CUDA ``name``
    (the config names the device type, every rank writes and reads the same config), and a
    UsageError for a non-CUDA one (NCCL reduces CUDA tensors only)."""
    dev = torch.device(name)
    own = rank_device()  # also inside distributed.solo(): a rank training a case alone
    if own is None or own.type != "cuda":
        return dev
    if dev.type != "cuda":
        raise UsageError(f"device={name!r} under an NCCL process group: NCCL reduces CUDA "
                         "tensors only; leave --device unset (each rank trains on its own GPU) "
                         "or launch on a gloo group")
    return own


def check_world(config: TrainConfig, world: int | None = None) -> None:
    """UsageError when ``config`` cannot train data-parallel on ``world`` ranks (None: the
    joined group's): ``update_forward='sampler'`` backpropagates through rank 0's sampling
    calls."""
    world = rank_world()[1] if world is None else world
    if world > 1 and config.update_forward == "sampler":
        raise UsageError(f"update_forward='sampler' is not valid with {world} ranks (torchrun, "
                         "WORLD_SIZE > 1): the loss backpropagates through the sampler's own "
                         "calls, which run on rank 0 only; use update_forward='teacher-forced' "
                         "or one process")


def check_same_config(config: TrainConfig) -> None:
    """UsageError on every rank when the ranks' configs differ (``device`` aside: each rank's
    own, :func:`train_device`), naming the fields."""
    if rank_world()[1] == 1:
        return
    mine = {k: v for k, v in config.to_dict().items() if k != "device"}
    configs = gather_objects(mine)
    diff = sorted({k for c in configs for k in c if c.get(k) != configs[0].get(k)})
    if diff:
        raise UsageError(f"the ranks were given different training configs for {diff} "
                         f"(rank 0: {[configs[0].get(k) for k in diff]}); launch every rank "
                         "with the same flags and config file")


def broadcast_module(model: torch.nn.Module) -> None:
    """Rank 0's parameters and floating buffers on every rank, in place: every rank starts
    from the same weights whatever each built (a warm start trained or read on each)."""
    if rank_world()[1] == 1:
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                dist.broadcast(t.data, src=0)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor ``t`` inside (dataclass fields, dicts, lists, tuples) replaced
    by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def share(obj: Any, device: torch.device) -> Any:
    """Rank 0's ``obj`` (a batch, tensors, records) on every rank, its tensors on ``device``
    (the rank's model's); rank 0 keeps its own object. Tensors travel through the CPU."""
    rank, world = rank_world()
    if world == 1:
        return obj
    got = broadcast_object(_map_tensors(obj, lambda t: t.detach().cpu()) if rank == 0 else None)
    return obj if rank == 0 else _map_tensors(got, lambda t: t.to(device))


def sharded_logprobs(model: torch.nn.Module, batch: RolloutBatch, groups: torch.Tensor,
                     rows: Callable[[torch.nn.Module, RolloutBatch, int], int | None] | None = None
                     ) -> torch.Tensor:
    """``[len(groups), G, T]`` teacher-forced log-probs of ``groups`` (``response_logprobs``
    with ``shared_prompt=True``), each rank computing ``groups[rank::world]`` only.

    The others' rows are all-gathered (constants); the rank's own are put back with
    ``index_copy`` and keep their graph (grad mode on), so a loss on the result backpropagates
    into this rank's share of the gradient. ``rows(model, batch, n)``: rows per forward over
    ``n`` groups (``varbench.rollout.logprobs.logprob_rows``; None: one forward).
    """
    rank, world = rank_world()
    if world == 1:
        return response_logprobs(model, batch, groups, shared_prompt=True,
                                 rows=rows(model, batch, len(groups)) if rows else None)
    k = len(groups)
    _, G, T = batch.tokens.shape
    dev = batch.tokens.device
    # response_logprobs is in float32 at least: the model's dtype promoted to float32
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    mine = torch.arange(rank, k, world, device=groups.device)
    if len(mine):
        local = response_logprobs(model, batch, groups[mine], shared_prompt=True,
                                  rows=rows(model, batch, len(mine)) if rows else None)
        if local.dtype != dtype:
            raise RuntimeError(f"sharded_logprobs: response_logprobs gave {local.dtype}, "
                               f"expected {dtype} (the gathered rows need one dtype)")
    else:  # fewer groups than ranks: this rank has none (its gradient share is 0)
        local = torch.zeros(0, G, T, dtype=dtype, device=dev)
    per = -(-k // world)
    pad = torch.zeros(per, G, T, dtype=dtype, device=dev)
    pad[:len(mine)] = local.detach()
    parts = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(parts, pad)
    full = torch.empty(k, G, T, dtype=dtype, device=dev)
    for r, part in enumerate(parts):
        pos = torch.arange(r, k, world, device=dev)
        full[pos] = part[:len(pos)]
    if len(mine) and local.requires_grad:
        full = full.index_copy(0, mine.to(dev), local)
    return full


def all_reduce_grads(params: list[torch.Tensor]) -> None:
    """Sum every rank's ``.grad`` of ``params`` in place (the one-process gradient), before
    clipping. A parameter with a gradient on some rank only gets zeros on the others first;
    one with none on any rank keeps ``grad = None`` (AdamW skips it, as in one process).
    Flattened into buckets of one dtype, so a step is a few all-reduces, not one per tensor."""
    if rank_world()[1] == 1 or not params:
        return
    dev = params[0].device
    have = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=dev)
    dist.all_reduce(have, op=dist.ReduceOp.MAX)
    for p, h in zip(params, have.tolist(), strict=True):
        if h and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.dtype, g.device), []).append(g)
    for group in by_kind.values():
        start = 0
        while start < len(group):
            bucket, n = [], 0
            while start < len(group) and (not bucket or n + group[start].numel() <= _BUCKET):
                bucket.append(group[start])
                n += group[start].numel()
                start += 1
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            off = 0
            for g in bucket:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
