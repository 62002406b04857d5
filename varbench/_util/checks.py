"""Boundary checks shared by every module: errors name the argument, the value and the choices.

Bad input raises :class:`UsageError` (a ``ValueError``) or :class:`UsageTypeError` (also a
``TypeError``), so callers that catch the builtin types keep working while the command line can
tell a user's mistake (one line, exit 2) from an internal bug (a traceback).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


class UsageError(ValueError):
    """Bad input from the user: an argument, a value, a file. The message names all three."""


class UsageTypeError(UsageError, TypeError):
    """Bad input of the wrong type (also a ``TypeError``)."""


class UsageFileNotFoundError(UsageError, FileNotFoundError):
    """A file or directory the user named does not exist (also a ``FileNotFoundError``)."""


def check_choice(arg: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    choices = list(choices)
    if value not in choices:
        raise UsageError(f"{arg}={value!r} is not valid; choose one of {sorted(map(str, choices))}")


def check_shape(arg: str, tensor: torch.Tensor, shape: Sequence[int | None]) -> None:
    """Raise ValueError unless ``tensor`` has ``shape`` (None matches any size)."""
    if not isinstance(tensor, torch.Tensor):
        raise UsageTypeError(f"{arg} must be a torch.Tensor, got {type(tensor).__name__}")
    ok = tensor.dim() == len(shape) and all(
        s is None or s == d for s, d in zip(shape, tensor.shape, strict=False)
    )
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise UsageError(f"{arg} has shape {list(tensor.shape)}, expected {want}")


def check_positive_int(arg: str, value: Any, minimum: int = 1) -> int:
    """Return ``value`` as int, raising ValueError when it is not an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{arg}={value!r} is not valid; expected an integer >= {minimum}")
    return value
