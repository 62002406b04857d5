"""torch.distributed set-up for commands launched by ``torchrun`` (gloo on CPU, NCCL on GPUs).

    torchrun --standalone --nproc_per_node 2 -m varbench check mypkg.adv:my_estimator

``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR /
MASTER_PORT; :func:`init_from_env` joins the process group when WORLD_SIZE > 1. The backend
(:func:`choose_backend`) is NCCL only when every rank of this node has a GPU of its own
(``LOCAL_RANK`` set and below ``torch.cuda.device_count()``, which is at least the node's rank
count), otherwise gloo; the choice and its reason are printed once on stderr. Under NCCL rank
``LOCAL_RANK`` computes on ``cuda:LOCAL_RANK``; under a multi-rank gloo group every rank
computes on the CPU (:func:`rank_device`), so two ranks never share GPU 0 by accident. Work is
split by the library (see :func:`varbench.testing.bias.chunked_estimates`); only rank 0 prints.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from varbench._util.checks import UsageError


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}={raw!r} is not an integer") from None


def choose_backend() -> tuple[str, str]:
    """``(backend, reason)`` for this rank: ``"nccl"`` only with one GPU per local rank.

    NCCL needs ``LOCAL_RANK`` (which GPU is this rank's), ``torch.cuda.device_count() >=
    LOCAL_WORLD_SIZE`` (ranks on this node; WORLD_SIZE when unset) and ``LOCAL_RANK <
    device_count``; anything else is gloo, with the reason in words.
    """
    if not torch.cuda.is_available():
        return "gloo", "no CUDA device is visible"
    n_gpu = torch.cuda.device_count()
    local_rank = _env_int("LOCAL_RANK")
    local_world = _env_int("LOCAL_WORLD_SIZE") or _env_int("WORLD_SIZE") or 1
    if local_rank is None:
        return "gloo", (f"LOCAL_RANK is not set, so this rank's GPU is unknown ({n_gpu} GPU(s) "
                        "visible); launch with torchrun to use NCCL")
    if n_gpu < local_world:
        return "gloo", (f"{n_gpu} GPU(s) for {local_world} ranks on this node; NCCL needs one "
                        "GPU per rank")
    if local_rank >= n_gpu:
        return "gloo", f"LOCAL_RANK={local_rank} but only {n_gpu} GPU(s) are visible"
    return "nccl", f"one GPU per rank ({n_gpu} GPU(s), {local_world} rank(s) on this node)"


_STATE: dict[str, str] = {}  # backend and reason of the group this process joined


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Join the process group described by torchrun's environment; returns (rank, world).

    ``backend`` None: :func:`choose_backend`. ``torch.cuda.set_device(LOCAL_RANK)`` is called
    only under NCCL. Rank 0 prints the backend and why on stderr.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        if backend is None:
            backend, reason = choose_backend()
        else:
            reason = "requested by the caller"
        if backend == "nccl":
            local_rank = _env_int("LOCAL_RANK")
            if local_rank is None:
                raise UsageError("backend='nccl' needs LOCAL_RANK (set by torchrun) to pick "
                                 "this rank's GPU")
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
        _STATE.update(backend=backend, reason=reason)
        if dist.get_rank() == 0:
            where = ("each rank on its own GPU" if backend == "nccl"
                     else "every rank on the CPU unless --device says otherwise")
            print(f"varbench: process group of {world} ranks on {backend} ({reason}); "
                  f"{where}", file=sys.stderr, flush=True)
    return dist.get_rank(), dist.get_world_size()


def refuse_multi_rank(command: str, instead: str) -> None:
    """Raise UsageError naming WORLD_SIZE when ``command`` is launched with several ranks.

    For commands that do not split their work across ranks (yet): every rank would repeat the
    whole run and write the same files, so they stop before any work instead. ``instead``: what
    to run in its place, in words.
    """
    world = _env_int("WORLD_SIZE") or 1
    if world > 1:
        raise UsageError(f"`varbench {command}` does not run data-parallel, but WORLD_SIZE={world} "
                         f"(torchrun with {world} ranks); every rank would repeat the whole run. "
                         f"Launch it as one process (WORLD_SIZE unset or 1); {instead}")


def rank_device() -> torch.device | None:
    """The device this rank computes on by default inside a joined multi-rank group:
    ``cuda:LOCAL_RANK`` under NCCL, the CPU under any other backend; None outside a group (the
    caller chooses: one process takes the GPU when there is one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shutdown() -> None:
    """Leave the process group (no-op when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STATE.clear()


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
