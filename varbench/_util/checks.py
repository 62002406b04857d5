"""Boundary checks shared by every module: errors name the argument, the value and the choices.

Bad input raises :class:`UsageError` (a ``ValueError``) or :class:`UsageTypeError` (also a
``TypeError``), so callers that catch the builtin types keep working while the command line can
tell a user's mistake (one line, exit 2) from an internal bug (a traceback).
"""

from __future__ import annotations

import math
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


def check_nonempty(arg: str, values: Any) -> list:
    """``values`` as a list; UsageError when it is empty (an empty list would compute nothing
    and report nothing) or a bare string (one name where a list of names is expected)."""
    if isinstance(values, (str, bytes)):
        raise UsageError(f"{arg}={values!r} is not valid; expected a list of values, e.g. "
                         f"[{values!r}]")
    out = list(values)
    if not out:
        raise UsageError(f"{arg}=[] is empty; give at least one value")
    return out


def check_finite_number(arg: str, value: Any, *, minimum: float | None = None,
                        strict: bool = False) -> float:
    """``value`` as float; UsageError unless it is a finite real number (>= / > ``minimum``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if strict else value >= minimum
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum}"
        raise UsageError(f"{arg}={value!r} is not valid; expected a finite number{bound}")
    return float(value)


def check_device(arg: str, value: Any, *, dtype: torch.dtype | None = None) -> torch.device:
    """``value`` as a torch.device that exists on this machine and can hold data (and, given
    ``dtype``, hold and compute in it); UsageError naming ``arg`` otherwise (a typo,
    ``cuda``/``cuda:N``/``mps`` where there is no such device, ``meta``, which holds no values,
    or a dtype the device lacks). The one device check of the library and the CLI."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"{arg}={value!r} is not valid; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise UsageError(f"{arg}={value!r}: no CUDA device is visible here; use cpu")
        if dev.index is not None and dev.index >= n:
            raise UsageError(f"{arg}={value!r}: only {n} CUDA device(s) are visible")
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps")
                                    and torch.backends.mps.is_available()):
        raise UsageError(f"{arg}={value!r}: MPS is not available here; use cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"{arg}={value!r} is not valid; use cpu, cuda, cuda:N or mps")
    if dtype is not None:
        _check_dtype_on(arg, dev, dtype)
    return dev


def _check_dtype_on(arg: str, dev: torch.device, dtype: torch.dtype) -> None:
    """UsageError unless ``dev`` can hold and compute in ``dtype`` (bfloat16 needs a GPU with
    bf16 arithmetic, or the CPU; float16 on the CPU runs but slowly and is allowed)."""
    flag = "--dtype" if arg.startswith("--") else "dtype"
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.bfloat16 and dev.type == "cuda" and not torch.cuda.is_bf16_supported(
            including_emulation=False):
        raise UsageError(f"{flag}=bfloat16 is not supported on {arg}={str(dev)!r} (this GPU "
                         "has no bfloat16 arithmetic); choose one of ['float16', 'float32']")
    if dtype in (torch.bfloat16, torch.float16) and dev.type == "mps":
        try:
            (torch.ones(2, 2, dtype=dtype, device=dev) @ torch.ones(2, 2, dtype=dtype,
                                                                    device=dev)).cpu()
        except (RuntimeError, TypeError) as err:
            raise UsageError(f"{flag}={name} is not supported on {arg}={str(dev)!r} ({err}); "
                             f"use {flag} float32") from None
    if dtype == torch.float64 and dev.type == "mps":
        raise UsageError(f"{flag}=float64 is not supported on {arg}='mps'; use float32")


def check_finite_at(arg: str, tensor: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """UsageError naming ``arg`` and the first index when the floating ``tensor`` holds NaN or
    inf where ``mask`` (same shape, bool or 0/1; None: everywhere) is set. One host read when
    every value is finite (a finite total has finite entries)."""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor.sum())):
        return
    bad = ~torch.isfinite(tensor)
    if mask is not None:
        bad &= mask != 0
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        if len(at) == 3:  # [P, G, T]: name the prompt, the response and the token
            where, unit = f"token [p={at[0]}, g={at[1]}, t={at[2]}]", "token"
        else:
            where, unit = f"index {at}", "value"
        raise UsageError(f"{arg} contains NaN or inf at valid {where} ({int(bad.sum())} such "
                         f"{unit}(s)); pass finite values")


def check_scheme_tensors(rewards: torch.Tensor, mask: torch.Tensor,
                         tensors: dict[str, torch.Tensor | None]) -> None:
    """Boundary checks of an estimator's tensor arguments (one home for all of them).

    ``tensors`` (``[P, G, T]`` each, or None) must be finite where ``mask`` is set: a NaN in
    ``logprobs``, ``token_weights`` or importance weights would otherwise turn into NaN
    advantages silently. ``rewards`` ([P, G] or [P, G, T], finite, checked by the caller) must
    spread little enough that centring and scaling stay finite in their dtype: a group's
    deviations from its mean, squared and summed over G, are at most ``G spread^2``, so each
    group's ``max r - min r`` (taken in float64) must be ``<= sqrt(finfo.max / G)`` (about
    1.8e19 / sqrt(G) in float32). Equal huge rewards are fine (they centre to 0); +/-3e38 is not.
    """
    for name, t in tensors.items():
        if t is not None:
            check_finite_at(name, t, mask)
    if not (rewards.is_floating_point() and rewards.numel()):
        return
    G = rewards.shape[1]
    bound = math.sqrt(torch.finfo(rewards.dtype).max / G)
    if rewards.dim() == 2:
        r = rewards.double()
        hi, lo = r.amax(1), r.amin(1)
    else:  # token rewards: the spread of the valid tokens' values within each group
        r = rewards.double().reshape(rewards.shape[0], -1)
        m = mask.reshape(mask.shape[0], -1)
        hi = torch.where(m, r, -math.inf).amax(1)
        lo = torch.where(m, r, math.inf).amin(1)
    spread = (hi - lo).nan_to_num(0.0, posinf=0.0)  # a group without valid tokens: no spread
    if bool((spread > bound).any()):
        p = int((spread > bound).nonzero()[0])
        raise UsageError(
            f"rewards of group p={p} span {float(lo[p]):.3g} .. {float(hi[p]):.3g}, a spread "
            f"beyond {bound:.3g}, the largest that group centring and scaling can represent in "
            f"{str(rewards.dtype).split('.')[-1]} at G={G}; rescale the rewards (or pass them "
            "as float64)")
