"""The one place a policy is built from its description: a preset (random init or warm-started
on a task) or a local checkpoint directory.

The application layer (``varbench.app.specs``) parses what a user typed and calls
:func:`build_policy`; library code that starts from a config (the trainer, the validation
experiment) calls it too, so every route builds a given description the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from varbench._util.checks import UsageError
from varbench.models import Policy, load_policy, presets
from varbench.models import build_policy as build_preset
from varbench.tasks import Task


def is_checkpoint_dir(spec: str | Path) -> bool:
    """Whether ``spec`` names a local Hugging Face checkpoint directory (has config.json)."""
    p = Path(spec).expanduser()
    return p.is_dir() and (p / "config.json").is_file()


def build_policy(
    spec: str | Path,
    *,
    task: Task | None = None,
    warm: bool = False,
    seed: int = 0,
    warm_seed: int | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    progress: bool | None = None,
) -> Policy:
    """The policy ``spec`` names: a preset name or a local checkpoint directory.

    A preset is built at random initialisation from ``seed``, or, with ``warm=True``,
    warm-started on ``task`` from ``warm_seed`` (default ``seed``; cached, see
    :func:`varbench.train.warm_start`). A checkpoint directory is loaded as it is (its stored
    dtype unless ``dtype`` is given); warm-starting one is refused. Raises UsageError naming
    the spec and the presets when ``spec`` is neither.
    """
    name = str(spec)
    if name in presets():
        if warm:
            if task is None:
                raise UsageError(f"warm-starting policy {name!r} needs a task")
            from varbench.train.warmstart import warm_start

            policy = warm_start(name, task, seed=seed if warm_seed is None else warm_seed,
                                progress=progress)
        else:
            policy = build_preset(name, seed=seed)
        if dtype is not None or device is not None:
            policy.model.to(device=device, dtype=dtype)
        return policy
    if is_checkpoint_dir(name):
        if warm:
            raise UsageError(f"policy={name!r} is a checkpoint directory: warm start needs a "
                             f"preset {presets()}; pass the directory without warm start")
        return load_policy(name, dtype=dtype, device=device,
                           trust_remote_code=trust_remote_code)
    raise UsageError(f"policy={name!r} is not valid; choose a preset {presets()} or a local "
                     "checkpoint directory containing config.json")
