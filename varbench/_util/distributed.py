"""torch.distributed set-up for commands launched by ``torchrun`` (gloo on CPU, NCCL on GPUs).

    torchrun --standalone --nproc_per_node 2 -m varbench check mypkg.adv:my_estimator

``torchrun`` sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; :func:`init_from_env` joins
the process group when WORLD_SIZE > 1 (backend: NCCL when CUDA is available, else gloo; the
code path is the same). Work is split by the library (see
:func:`varbench.testing.bias.chunked_estimates`); only rank 0 prints.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Join the process group described by torchrun's environment; returns (rank, world)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def shutdown() -> None:
    """Leave the process group (no-op when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the joined process group; (0, 1) when none was joined."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj: object) -> list[object]:
    """Every rank's ``obj`` in rank order (``all_gather_object``; ``[obj]`` in one process).

    Pickles through the backend, so it is meant for small per-prompt records, not tensors of
    model size. With NCCL, objects travel via the current CUDA device (set by
    :func:`init_from_env`).
    """
    rank, world = rank_world()
    if world == 1:
        return [obj]
    out: list[object] = [None] * world
    dist.all_gather_object(out, obj)
    return out
