"""Shared pieces of the torchrun tests: rank records compared with one process's."""

from __future__ import annotations

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
