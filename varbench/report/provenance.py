"""Provenance attached to every record set: versions, git commit, device, seeds, config, time."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def git_commit(path: str | Path | None = None) -> str | None:
    """The HEAD commit of the repository holding ``path`` (default: this package), or None."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    if out.returncode != 0 or not commit:
        return None
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=where, capture_output=True, text=True, timeout=5,
    )
    return commit + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def provenance(
    *,
    config: dict[str, Any],
    seeds: dict[str, int] | int | None,
    device: str | torch.device = "cpu",
    wall_time_s: float | None = None,
    model_dtype: str | dict[str, str] | None = None,
) -> dict[str, Any]:
    """A provenance dict: varbench/torch/transformers versions, commit, device, model dtype,
    seeds, config."""
    from varbench._util.version import VERSION as __version__

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        tf_version = None
    return {
        "varbench_version": __version__,
        "git_commit": git_commit(),
        "torch_version": torch.__version__,
        "transformers_version": tf_version,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "model_dtype": model_dtype,
        "seeds": seeds,
        "config": config,
        "wall_time_s": wall_time_s,
    }
