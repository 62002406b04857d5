"""Chunk sizes of the exact harness from the free memory of the model's device.

On the CPU the measured defaults stand (``DEFAULT_CHUNK`` tokens per batched backward, 256 MiB
of per-token gradients per block: tuned for caches, not for capacity). On CUDA a chunk of C
cotangents holds C copies of the backward's activation gradients (and, where the per-token
gradients are materialised, C gradients of the block), so C is read off the memory free on
the device (``torch.cuda.mem_get_info``) times ``memory_fraction`` (default 0.5, the rest left
to the forward's activations, the allocator's fragmentation and other processes). An explicit
``chunk_size`` always wins (the knob).
"""

from __future__ import annotations

import torch

from varbench._util.checks import UsageError, check_positive_int

# measured on the small preset (CPU, 1 thread, one sequence, process CPU seconds):
# T=128: 8 -> 1.50-1.57, 16 -> 1.60-1.68, 32 -> 1.86-1.97; T=512: 8 -> 25.6, 16 -> 26.9
DEFAULT_CHUNK = 8
BLOCK_BYTES = 1 << 28  # CPU: 256 MiB of per-token gradients per harness pass
MEMORY_FRACTION = 0.5  # CUDA: share of the free device memory a chunk may take
MAX_CHUNK = 512  # CUDA: cotangents per batched backward at most (the vmap's batch)


def free_device_bytes(device: torch.device | str) -> int | None:
    """Bytes free on a CUDA ``device`` (``torch.cuda.mem_get_info``), None on other devices."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def check_fraction(memory_fraction: float) -> float:
    """``memory_fraction`` must be a number in (0, 1]."""
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) or not (
            0 < memory_fraction <= 1):
        raise UsageError(f"memory_fraction={memory_fraction!r} is not valid; expected a number "
                         "in (0, 1]")
    return float(memory_fraction)


def cotangent_bytes(model: torch.nn.Module, length: int, n_grad: int = 0) -> int:
    """Estimated bytes one cotangent of the batched backward holds over a prefix of ``length``.

    Activation gradients per position: the logits' (vocabulary V) plus, per layer, about
    ``4 h + 3 i + heads * length`` floats (residual, attention in/out, MLP, scores) of the
    config's hidden size h and intermediate size i; ``n_grad`` more floats when the per-token
    gradient of a parameter block is materialised. float32 accounting (the harness upcasts
    the statistics). An estimate: a fraction below 1 leaves the margin.
    """
    cfg = getattr(model, "config", None)
    h = int(getattr(cfg, "hidden_size", 0) or 0)
    if h <= 0:  # not a transformers config: assume activations as large as the parameters
        n = sum(p.numel() for p in model.parameters())
        return 4 * (n + n_grad)
    i = int(getattr(cfg, "intermediate_size", 0) or 4 * h)
    n_layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    V = int(getattr(cfg, "vocab_size", 0) or 0)
    per_pos = V + n_layers * (4 * h + 3 * i + heads * length)
    return 4 * (length * per_pos + n_grad)


def auto_chunk(
    device: torch.device | str,
    item_bytes: int,
    *,
    chunk_size: int | None = None,
    default: int = DEFAULT_CHUNK,
    memory_fraction: float = MEMORY_FRACTION,
    cap: int = MAX_CHUNK,
) -> int:
    """Tokens per batched backward: ``chunk_size`` when given, ``default`` on a non-CUDA
    device, else ``floor(memory_fraction * free / item_bytes)`` clamped to ``[1, cap]``.

    ``item_bytes``: memory of one cotangent (:func:`cotangent_bytes`).
    """
    if chunk_size is not None:
        return check_positive_int("chunk_size", chunk_size)
    budget = _free_budget(device, memory_fraction)
    if budget is None:
        return default
    return max(1, min(int(cap), budget // max(1, int(item_bytes))))


def auto_block_bytes(
    device: torch.device | str,
    *,
    block_bytes: int | None = None,
    default: int = BLOCK_BYTES,
    memory_fraction: float = MEMORY_FRACTION,
) -> int:
    """Bytes of per-token gradients per harness pass: ``block_bytes`` when given, ``default``
    on a non-CUDA device, else half of ``memory_fraction`` of the free memory (the other half
    is the chunk's activation gradients)."""
    if block_bytes is not None:
        return check_positive_int("block_bytes", block_bytes)
    budget = _free_budget(device, memory_fraction)
    return default if budget is None else max(1, budget // 2)


def _free_budget(device: torch.device | str, memory_fraction: float) -> int | None:
    """``memory_fraction`` of the device's free bytes; None where it is not measured (CPU)."""
    frac = check_fraction(memory_fraction)
    free = free_device_bytes(device)
    return None if free is None else int(frac * free)
