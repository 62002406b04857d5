"""Chunk sizes of the exact harness: thin calls into the one memory plan
(:mod:`varbench.models.memplan`).

On the CPU the measured defaults stand (``DEFAULT_CHUNK`` tokens per batched backward, 256 MiB
of per-token gradients per block: tuned for caches, not for capacity). On CUDA the chunk is the
plan's: the largest number of cotangents whose planned peak (the chunk forward's kept
activations, the vocabulary's cotangents at ``e + 4 (+4)`` bytes per element, a tied head's
per-token gradient ``[C, V h]``, every module output's cotangent) fits ``memory_fraction``
(default 0.5) of the memory free on the device. An explicit ``chunk_size`` always wins.
"""

from __future__ import annotations

import torch

from varbench._util.checks import UsageError, check_positive_int
from varbench.models import memplan
from varbench.models.memplan import MAX_COTANGENTS as MAX_CHUNK
from varbench.models.memplan import MEMORY_FRACTION, ModelShape

# measured on the small preset (CPU, 1 thread, one sequence, process CPU seconds):
# T=128: 8 -> 1.50-1.57, 16 -> 1.60-1.68, 32 -> 1.86-1.97; T=512: 8 -> 25.6, 16 -> 26.9
DEFAULT_CHUNK = 8
BLOCK_BYTES = 1 << 28  # CPU: 256 MiB of per-token gradients per harness pass
# a block of per-token gradients exists about 2.5 times at once (autograd's batched result, the
# vmap's stack of it, an embedding's per-cotangent backward; traced on the CPU,
# tests/test_memplan_budget.py): a measured budget is shared out in this many copies
BLOCK_COPIES = 3

__all__ = ["BLOCK_BYTES", "BLOCK_COPIES", "DEFAULT_CHUNK", "MAX_CHUNK", "MEMORY_FRACTION",
           "auto_block_bytes", "check_fraction", "cotangent_bytes", "free_device_bytes",
           "shape_token_plan", "token_plan"]


def free_device_bytes(device: torch.device | str) -> int | None:
    """Bytes free on a CUDA ``device`` (:func:`varbench.models.memplan.free_device_bytes`),
    None on other devices."""
    return memplan.free_device_bytes(device)


def check_fraction(memory_fraction: float) -> float:
    """``memory_fraction`` must be a number in (0, 1]."""
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) or not (
            0 < memory_fraction <= 1):
        raise UsageError(f"memory_fraction={memory_fraction!r} is not valid; expected a number "
                         "in (0, 1]")
    return float(memory_fraction)


def cotangent_bytes(model: torch.nn.Module, length: int, n_grad: int = 0, *,
                    path: str = "vectors") -> int:
    """Planned bytes one cotangent of the batched backward adds over a prefix of ``length``
    (:func:`varbench.models.memplan.unit_bytes`); ``n_grad`` parameter elements whose
    per-token gradient is materialised. ``path='token_norms'`` counts a tied head's
    per-token gradient (the ghost harness forms it); ``'vectors'`` leaves it to the block."""
    return memplan.unit_bytes(ModelShape.from_model(model), path, length,
                              materialised=n_grad)


def token_plan(model: torch.nn.Module, B: int, L: int, device: torch.device | str, *,
               path: str = "token_norms", chunk_size: int | None = None, n_grad: int = 0,
               memory_fraction: float = MEMORY_FRACTION) -> memplan.Plan:
    """The plan of a per-token path over ``B`` rows of ``L`` positions on ``device``: the
    knob's chunk when given, ``DEFAULT_CHUNK`` without a measured budget (CPU), else the
    largest that fits; refused (UsageError) when one cotangent cannot fit the budget."""
    return shape_token_plan(ModelShape.from_model(model), B, L, free_device_bytes(device),
                            path=path, chunk_size=chunk_size, n_grad=n_grad,
                            memory_fraction=memory_fraction, what=type(model).__name__)


def shape_token_plan(shape: ModelShape, B: int, L: int, free: int | None, *,
                     path: str = "token_norms", chunk_size: int | None = None, n_grad: int = 0,
                     memory_fraction: float = MEMORY_FRACTION,
                     what: str = "the model") -> memplan.Plan:
    """:func:`token_plan` of a model known by its ``shape`` (named ``what`` in a refusal) on
    a device with ``free`` bytes free beside the model (None: not measured, the CPU)."""
    frac = check_fraction(memory_fraction)
    budget = None if free is None else int(frac * free)
    if chunk_size is not None:
        check_positive_int("chunk_size", chunk_size)
        budget = None
    p = memplan.plan(shape, path, B, L, budget, default=chunk_size or DEFAULT_CHUNK,
                     materialised=n_grad)
    return memplan.check_plan(p, f"a {L}-position sequence of {what}")


def auto_block_bytes(
    device: torch.device | str,
    *,
    block_bytes: int | None = None,
    default: int = BLOCK_BYTES,
    memory_fraction: float = MEMORY_FRACTION,
    chunk_plan: memplan.Plan | None = None,
    held: int = 0,
) -> int:
    """Bytes of per-token gradients per harness pass: ``block_bytes`` when given, ``default``
    on a non-CUDA device, else what the chunk's plan (``chunk_plan``: its planned peak) and
    ``held`` bytes beside the block (a count sketch's hash) leave of ``memory_fraction`` of the
    free memory, over :data:`BLOCK_COPIES`; without a plan, half of the fraction (the share
    :func:`token_plan` is given for the chunk's activation gradients)."""
    if block_bytes is not None:
        return check_positive_int("block_bytes", block_bytes)
    budget = _free_budget(device, memory_fraction)
    if budget is None:
        return default
    if chunk_plan is None:
        return max(1, budget // 2)
    left = budget - chunk_plan.peak_bytes - int(held)
    if left < BLOCK_COPIES:
        raise UsageError(f"no memory is left for the per-token gradient block: the chunk's "
                         f"plan ({chunk_plan.describe()}) and {memplan.gib(held)} of sketch "
                         f"state take the budget of {memplan.gib(budget)}; pass a smaller "
                         "chunk_size")
    return left // BLOCK_COPIES


def _free_budget(device: torch.device | str, memory_fraction: float) -> int | None:
    """``memory_fraction`` of the device's free bytes; None where it is not measured (CPU)."""
    frac = check_fraction(memory_fraction)
    free = free_device_bytes(device)
    return None if free is None else int(frac * free)
