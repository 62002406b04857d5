"""Specs a user types, resolved in one place: policies, tasks, dtypes, devices, ``KEY=VALUE``.

Every command and every suite case goes through these functions, so ``--knob n=3`` means the
same thing to ``sample``, ``train``, ``proxy`` and a suite's ``knobs = { n = 3 }``.

- ``--knob KEY=VALUE``: VALUE is a TOML literal (``n=3`` an integer, ``eps=1e-4`` a float,
  ``flag=true`` a boolean, ``items=[1, 2]`` a list, ``name="x"`` a string); a bare word that is
  not a TOML literal is a string (``verifier=number``).
- policy: a preset name or a local checkpoint directory, optionally warm-started on a task with
  demonstrations; ``--dtype``, ``--device``, ``--trust-remote-code`` and ``--add-task-tokens``
  apply to both.
- task: a registered name, ``MODULE:ATTR`` (a user's Task subclass or factory), an installed
  ``varbench.tasks`` entry point, or a data file / datasets directory (a dataset task).
- scheme: a registered scheme name or a user's ``MODULE:FUNCTION`` estimator.
- dtype: ``auto`` (the checkpoint's own) or a floating torch dtype name; device: ``cpu``,
  ``cuda``, ``cuda:N``, ``mps``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from varbench._util.checks import UsageError, check_device

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
DEVICE_HELP = ("cpu, cuda, cuda:N or mps (default: cuda when a GPU is visible, else cpu; "
               "under torchrun the rank's own GPU with NCCL, the cpu with gloo)")


def parse_knob(text: str, *, flag: str = "--knob") -> tuple[str, Any]:
    """``"KEY=VALUE"`` -> ``(KEY, value)`` with VALUE read as a TOML literal (else a string)."""
    key, sep, raw = str(text).partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"{flag} {text!r} is not valid; expected KEY=VALUE, e.g. n=4")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word is a string
    return key, value


def parse_knobs(items: Iterable[str] | None, *, flag: str = "--knob") -> dict[str, Any]:
    """Repeated ``KEY=VALUE`` flags as a dict (a later KEY wins)."""
    return dict(parse_knob(item, flag=flag) for item in (items or ()))


def resolve_task(spec: str, knobs: Mapping[str, Any] | None = None):
    """The Task ``spec`` names, with its knobs applied: see :func:`varbench.tasks.get_task`."""
    from varbench.tasks import get_task

    return get_task(spec, **dict(knobs or {}))


def check_task_spec(spec: str, knobs: Mapping[str, Any] | None = None):
    """Validate a task spec with its knobs without calling a user's code (see
    :func:`varbench.tasks.check_task`): the Task for varbench's own tasks and data files,
    None for user code (imported and checked by type only)."""
    from varbench.tasks import check_task

    return check_task(spec, **dict(knobs or {}))


def resolve_scheme(ref: str) -> str:
    """A registered scheme name as it is, or a user's ``MODULE:FUNCTION`` estimator (any shape
    ``register_scheme`` takes) imported and registered under that reference, which is returned.

    So the trainer, the variance analysis and ``check`` accept a user's estimator the same way.
    """
    from varbench._util.imports import import_object, is_reference
    from varbench.estimators import register_scheme, schemes

    if ref in schemes():
        return ref
    if is_reference(ref):
        register_scheme(ref)(import_object(ref, what="scheme"))
        return ref
    raise UsageError(f"scheme={ref!r} is not valid; choose one of {schemes()} or give "
                     "MODULE:FUNCTION (an estimator imported by name)")


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"auto"``/None -> None (keep the stored dtype); otherwise the torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return None
    if name not in DTYPES:
        raise UsageError(f"--dtype={name!r} is not valid; choose one of {list(DTYPES)}")
    return getattr(torch, name)


def default_device() -> str:
    """The device a command uses when ``--device`` is not given: ``cuda`` when a GPU is
    visible, else ``cpu``; inside a torchrun group the rank's own device (``cuda:LOCAL_RANK``
    under NCCL, ``cpu`` under gloo: see :func:`varbench._util.distributed.rank_device`)."""
    from varbench._util.distributed import rank_device

    dev = rank_device()
    if dev is not None:
        return str(dev)
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(name: str | torch.device | None) -> torch.device:
    """The torch device ``name`` names (None, ``""`` or ``"auto"``: :func:`default_device`),
    checked to exist. The one resolver of ``--device`` and of a suite case's ``device``."""
    if isinstance(name, torch.device):
        name = str(name)
    name = default_device() if name in (None, "", "auto") else name
    return check_device("--device", name)


def resolve_policy(spec: str, *, task=None, warm: bool = False, seed: int = 0,
                   warm_seed: int | None = None, dtype: str | torch.dtype | None = None,
                   device: str | torch.device | None = None, trust_remote_code: bool = False,
                   add_task_tokens: bool = False, progress: bool | None = None):
    """The Policy ``spec`` names: a preset (random init from ``seed``) or a local checkpoint
    directory, optionally warm-started on ``task``; ``dtype`` ("auto": the stored one) and
    ``device`` (None: :func:`default_device`; checked to exist and to support the dtype)
    before any work; see
    :func:`varbench.train.policies.build_policy`.
    """
    from varbench.train.policies import build_policy

    dtype = resolve_dtype(dtype)
    device = resolve_device(device)  # None: cuda when available, else cpu
    return build_policy(spec, task=task, warm=warm, seed=seed, warm_seed=warm_seed, dtype=dtype,
                        device=device, trust_remote_code=trust_remote_code,
                        add_task_tokens=add_task_tokens, progress=progress)


def policy_kwargs(args) -> dict[str, Any]:
    """The precision / device / loading flags of a command as :func:`resolve_policy` keywords
    (``--dtype``, ``--device``, ``--trust-remote-code``, ``--add-task-tokens``)."""
    return {"dtype": getattr(args, "dtype", None), "device": getattr(args, "device", None),
            "trust_remote_code": bool(getattr(args, "trust_remote_code", False)),
            "add_task_tokens": bool(getattr(args, "add_task_tokens", False))}


def add_policy_flags(parser, *, dtype: bool = True) -> None:
    """``--dtype``, ``--device``, ``--trust-remote-code``, ``--add-task-tokens`` (one spelling
    for every command that builds a policy)."""
    if dtype:
        parser.add_argument("--dtype", default="auto", choices=list(DTYPES),
                            help="model dtype (default auto: the checkpoint's own; presets are "
                                 "float32); statistics stay float32 or better")
        parser.add_argument("--device", default=None, help=DEVICE_HELP)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a checkpoint's own Python code to run when loading it")
    parser.add_argument("--add-task-tokens", action="store_true",
                        help="add a toy task's symbols as tokens (resizing the embeddings) when "
                             "the tokenizer splits them")


STATES = ("random", "warm")
STATE_LABELS = {"random": "random init", "warm": "warm-started"}


def policy_states(spec: str, states: Iterable[str], task, *, seed: int = 0,
                  progress: bool | None = None, **policy: Any) -> dict[str, Any]:
    """``{state label: Policy}``: a checkpoint directory as it is (labelled by its name), or
    the preset at each requested state ("random": random init, "warm": warm-started on
    ``task``). ``policy``: :func:`resolve_policy`'s dtype / device / trust_remote_code /
    add_task_tokens."""
    from pathlib import Path

    from varbench.train.policies import is_checkpoint_dir

    if is_checkpoint_dir(spec):
        return {Path(spec).name: resolve_policy(spec, task=task, seed=seed, **policy)}
    out = {}
    for s in dict.fromkeys(states):
        if s not in STATES:
            raise UsageError(f"states={s!r} is not valid; choose one of {list(STATES)}")
        out[STATE_LABELS[s]] = resolve_policy(spec, task=task, warm=s == "warm", seed=seed,
                                              progress=progress, **policy)
    return out
