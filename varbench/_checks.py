"""Boundary checks shared by every module: errors name the argument, the value and the choices."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


def check_choice(arg: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{arg}={value!r} is not valid; choose one of {sorted(map(str, choices))}")


def check_shape(arg: str, tensor: torch.Tensor, shape: Sequence[int | None]) -> None:
    """Raise ValueError unless ``tensor`` has ``shape`` (None matches any size)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(tensor).__name__}")
    ok = tensor.dim() == len(shape) and all(
        s is None or s == d for s, d in zip(shape, tensor.shape, strict=False)
    )
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{arg} has shape {list(tensor.shape)}, expected {want}")


def check_positive_int(arg: str, value: Any, minimum: int = 1) -> int:
    """Return ``value`` as int, raising ValueError when it is not an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{arg}={value!r} is not valid; expected an integer >= {minimum}")
    return value
