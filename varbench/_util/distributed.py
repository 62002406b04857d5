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
Work split by whole cases (``varbench run`` / ``validate``) runs each rank's cases inside
:func:`solo` (:func:`each_rank_alone`), where the in-case collectives are off.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist

from varbench._util.checks import UsageError

T = TypeVar("T")


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


def env_world_size() -> int:
    """WORLD_SIZE as torchrun set it (1 when unset): the ranks a command was launched with,
    known before any rank joins the group (bad input is refused before the rendezvous)."""
    return _env_int("WORLD_SIZE") or 1


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


_SOLO = [0]  # depth of nested solo() blocks in this process


@contextlib.contextmanager
def solo() -> Iterator[None]:
    """Inside the block this rank works alone: :func:`rank_world` is ``(0, 1)``, so the
    library's in-case collectives (sharded analyses, gathers, barriers) are off, while
    :func:`rank_device` still names the rank's own device. For work split by whole cases
    (``varbench run`` / ``validate`` under torchrun: each rank its own shard of cases)."""
    _SOLO[0] += 1
    try:
        yield
    finally:
        _SOLO[0] -= 1


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the joined process group; (0, 1) when none was joined or inside
    :func:`solo`."""
    if not _SOLO[0] and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank (``broadcast_object_list``; ``obj`` in one process).

    Pickled through the backend: tensors inside must be on the CPU (a CUDA tensor would be
    unpickled on the sender's GPU index on every rank); move them to the rank's device after.
    """
    rank, world = rank_world()
    if world == 1:
        return obj
    box = [obj if rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait for every rank of the group (no-op in one process or inside :func:`solo`)."""
    if rank_world()[1] > 1:
        dist.barrier()


@contextlib.contextmanager
def lead_first() -> Iterator[None]:
    """Rank 0 runs the block first, then the other ranks (together): rank 0 fills a shared
    cache (a warm start) that the others then read instead of building it at the same time.
    No-op in one process or inside :func:`solo`."""
    rank, world = rank_world()
    if world > 1 and rank != 0:
        dist.barrier()
    try:
        yield
    finally:
        if world > 1 and rank == 0:
            dist.barrier()


def each_rank_alone(work: Callable[[int, int], T]) -> list[T]:
    """Every rank runs ``work(rank, world)`` inside :func:`solo`; every rank's result in rank
    order once all have finished (one process: ``[work(0, 1)]``).

    An exception on a rank is not left for the others to wait on: every rank's outcome is
    gathered, the failing rank re-raises its own, and the others raise a UsageError naming
    the failed rank(s) and their errors.
    """
    rank, world = rank_world()
    err: Exception | None = None
    out: T | None = None
    try:
        with solo():
            out = work(rank, world)
    except Exception as e:  # gathered below so that no rank waits on a failed one
        err = e
    if world == 1:
        if err is not None:
            raise err
        return [out]  # type: ignore[list-item]
    status = gather_objects((None, out) if err is None
                            else (f"{type(err).__name__}: {err}", None))
    if err is not None:
        raise err
    failed = [f"rank {r}: {msg}" for r, (msg, _) in enumerate(status) if msg is not None]
    if failed:
        raise UsageError(f"{len(failed)} other rank(s) failed ({'; '.join(failed)}); what "
                         "every rank finished is kept, rerun the same command to resume")
    return [res for _, res in status]


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
