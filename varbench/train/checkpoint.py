"""Resumable checkpoints: model (safetensors), Adam state (safetensors + JSON), RNG states.

A checkpoint is a directory ``RUN/checkpoints/step_000020/`` holding ``model.safetensors``,
``optimizer.safetensors`` (every tensor of the optimizer state and every generator state) and
``state.json`` (the optimizer's param groups, the loop's counters, the collapse detector) and
``varbench_sha256.json`` (the SHA-256 of each file, checked before anything is loaded).
It is written under a temporary name and renamed when complete, so a kill mid-write never
leaves a half checkpoint that looks finished. Nothing is unpickled on load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from varbench._util.checks import UsageError
from varbench._util.io import (
    IntegrityError,
    atomic_dir,
    atomic_write,
    verify_digest,
    write_digest,
    writing,
)

_PREFIX = "step_"


def checkpoint_dir(run_dir: str | Path) -> Path:
    """The directory that holds a run's checkpoints."""
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    generators: dict[str, torch.Generator],
    state: dict[str, Any],
    *,
    keep: int = 2,
) -> Path:
    """Write the checkpoint of ``step`` and keep only the ``keep`` most recent; returns its path.

    ``state`` must be JSON-serialisable (loop counters, collapse-detector history, config).
    """
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:06d}"
    with writing(final), atomic_dir(final) as tmp:  # a full disk: an OSError naming it
        save_model(model, str(tmp / "model.safetensors"))
        tensors, opt_json = _flatten_optimizer(optimizer.state_dict())
        for name, gen in generators.items():
            tensors[f"rng/{name}"] = gen.get_state()
        tensors["rng/torch_global"] = torch.get_rng_state()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        atomic_write(tmp / "state.json",
                     json.dumps({"step": step, "optimizer": opt_json, "state": state}))
        write_digest(tmp)  # moves into place with the files it covers
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Completed checkpoints of a run, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and p.is_dir()]
    return sorted(done, key=lambda p: int(p.name[len(_PREFIX) :]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The most recent completed checkpoint, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    generators: dict[str, torch.Generator],
) -> tuple[int, dict[str, Any]]:
    """Restore model, optimizer and generators in place; returns ``(step, state)``.

    A missing or corrupt file, or one that does not match the checkpoint's content hash
    (``varbench_sha256.json``), raises UsageError naming it (never a silent fresh start, never
    a resume from changed weights).
    """
    path = Path(path)
    try:
        verify_digest(path, "checkpoint")  # a flipped bit is refused, never loaded
    except PermissionError as err:
        raise UsageError(f"cannot read checkpoint {str(path)!r}: permission denied "
                         f"({err.filename or path})") from None
    except IntegrityError as err:
        raise UsageError(f"{err}; refusing to resume from it (delete the checkpoint directory "
                         "to resume from the previous one, or start afresh)") from None
    try:
        with open(path / "state.json") as fh:
            meta = json.load(fh)
        load_model(model, str(path / "model.safetensors"), strict=True)
        tensors = load_file(str(path / "optimizer.safetensors"))
    except (OSError, json.JSONDecodeError, RuntimeError, ValueError, SafetensorError) as err:
        raise UsageError(f"checkpoint {str(path)!r} is unreadable or corrupt: {err}") from None
    optimizer.load_state_dict(_unflatten_optimizer(tensors, meta["optimizer"]))
    for name, gen in generators.items():
        key = f"rng/{name}"
        if key not in tensors:
            raise UsageError(f"checkpoint {str(path)!r} has no generator state {name!r}")
        gen.set_state(tensors[key])
    torch.set_rng_state(tensors["rng/torch_global"])
    return int(meta["step"]), meta["state"]


def _flatten_optimizer(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, per_param in sd["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{idx}/{key}"] = value.detach().clone().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("state/"):
            _, idx, name = key.split("/", 2)
            state.setdefault(int(idx), {})[name] = value
    for idx, extra in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(extra)
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}
