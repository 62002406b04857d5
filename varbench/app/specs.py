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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from varbench._util.checks import UsageError, UsageTypeError, check_device
from varbench._util.config import DTYPES, resolve_dtype

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

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


@dataclass(frozen=True)
class PolicySpec:
    """The policy an analysis runs on, as a suite case and ``varbench proxy`` etc. spell it:
    one spec, validated one way (:meth:`from_dict`) for the command line and suites alike."""

    preset: str = "tiny"
    """Embedded preset (random init or warm-started, per state)."""
    checkpoint: str | None = None
    """A local Hugging Face checkpoint directory instead, used as is (no states)."""
    states: tuple[str, ...] = ("warm",)
    """Preset states side by side: random (init) and / or warm (warm-started on the task)."""
    dtype: str = "auto"
    """Model dtype: auto (the stored one) or a torch dtype name."""
    device: str = ""
    """"" (auto: cuda when available, else cpu), cpu, cuda, cuda:N or mps."""
    trust_remote_code: bool = False
    """Allow a checkpoint's own Python code to run when loading it."""
    add_task_tokens: bool = False
    """Add a toy task's symbols as tokens (resizing the embeddings)."""
    knobs: Mapping[str, Any] = field(default_factory=dict)
    """Task knobs, e.g. ``{n = 3}``."""

    @property
    def spec(self) -> str:
        """What :func:`policy_states` builds: the checkpoint directory, else the preset."""
        return self.checkpoint if self.checkpoint is not None else self.preset

    def settings(self, device: torch.device) -> dict[str, Any]:
        """The spec as an analysis's cache keys read it (the device by its type: CPU and CUDA
        generators draw apart, cuda:0 and cuda:1 alike)."""
        return {"preset": self.preset, "checkpoint": self.checkpoint,
                "states": list(self.states), "knobs": dict(self.knobs), "dtype": self.dtype,
                "device": device.type, "trust_remote_code": self.trust_remote_code,
                "add_task_tokens": self.add_task_tokens}

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The suite keys of a policy spec."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "policy") -> PolicySpec:
        """Validate ``data`` (some of :meth:`keys`); errors name ``source``, the key, the value
        and what is valid."""
        from varbench.models import presets

        def bad(key: str, what: str, err: type[UsageError] = UsageError) -> UsageError:
            return err(f"{source} key {key!r} = {data[key]!r} is not valid; {what}")

        unknown = [k for k in data if k not in cls.keys()]
        if unknown:
            raise UsageError(f"{source}: unknown key {unknown[0]!r}; valid keys: "
                             f"{sorted(cls.keys())}")
        out = {k: v for k, v in data.items() if v is not None}
        for key in ("preset", "dtype", "device") + (("checkpoint",) if "checkpoint" in out
                                                     else ()):
            if key in out and not isinstance(out[key], str):
                raise bad(key, "expected a string", UsageTypeError)
        for key in ("trust_remote_code", "add_task_tokens"):
            if key in out and not isinstance(out[key], bool):
                raise bad(key, "expected true or false", UsageTypeError)
        if "preset" in out and out["preset"] not in presets():
            raise bad("preset", f"choose one of {presets()}")
        if "checkpoint" in out and not Path(out["checkpoint"]).is_dir():
            raise bad("checkpoint", "expected an existing checkpoint directory")
        if "states" in out:
            states = out["states"]
            if isinstance(states, str) or not isinstance(states, (list, tuple)) or not states:
                raise bad("states", f"give a non-empty list of {list(STATES)}")
            for s in states:
                if s not in STATES:
                    raise bad("states", f"{s!r} is not one of {list(STATES)}")
            out["states"] = tuple(states)
        if "dtype" in out and out["dtype"] not in DTYPES:
            raise bad("dtype", f"choose one of {list(DTYPES)}")
        if out.get("device") not in (None, "", "auto"):
            try:
                check_device("device", out["device"])
            except UsageError as err:
                raise UsageError(f"{source} key 'device': {err}") from None
        if "knobs" in out:
            if not isinstance(out["knobs"], Mapping):
                raise bad("knobs", "expected a table, e.g. { n = 3 }", UsageTypeError)
            out["knobs"] = dict(out["knobs"])
        return cls(**out)

    def build(self, task, *, seed: int = 0, progress: bool | None = None,
              device: torch.device | None = None) -> dict[str, Any]:
        """``{state label: Policy}`` on ``task`` (:func:`policy_states`)."""
        return policy_states(self.spec, self.states, task, seed=seed, progress=progress,
                             dtype=self.dtype, device=device if device is not None
                             else resolve_device(self.device),
                             trust_remote_code=self.trust_remote_code,
                             add_task_tokens=self.add_task_tokens)
