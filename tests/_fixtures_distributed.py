"""Shared pieces of the torchrun tests: rank records compared with one process's."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pandas as pd


def assert_frames_close(a: pd.DataFrame, b: pd.DataFrame, name: str) -> None:
    """Same columns and rows; numeric columns to rtol 1e-5 (float32 models: derived ratios and
    sketches of another batch split round apart by ~1e-6), the rest exactly."""
    assert list(a.columns) == list(b.columns), name
    assert len(a) == len(b) and len(a) > 0, name
    for col in a.columns:
        x, y = a[col].to_numpy(), b[col].to_numpy()
        if pd.api.types.is_numeric_dtype(a[col]):
            np.testing.assert_allclose(x.astype(float), y.astype(float), rtol=1e-5, atol=1e-9,
                                       err_msg=f"{name}.{col}")
        else:
            assert list(x) == list(y), f"{name}.{col}"


def torchrun(args: list[str], *, ranks: int = 2, timeout: int = 300,
             env: dict | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node RANKS ARGS`` (one
    thread per rank, gloo on the CPU); with ``ok`` asserts it exited 0, showing its output
    when not."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(ranks), *args], env=full, text=True, capture_output=True, timeout=timeout)
    assert res.returncode == 0 or not ok, res.stdout[-4000:] + res.stderr[-4000:]
    return res
