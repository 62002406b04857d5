"""Deprecated: the suite runner moved to :mod:`varbench.app` (kept for one release)."""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = ("Case", "RunSummary", "Suite", "SuiteError", "compare_reports", "load_suite",
          "merge_outputs", "run_suite")


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'varbench.runner' has no attribute {name!r}")
    warnings.warn(f"varbench.runner.{name} moved to varbench.app.{name}; the old path goes "
                  "away in the next release", DeprecationWarning, stacklevel=2)
    import varbench.app

    value = getattr(varbench.app, name)
    globals()[name] = value  # warn once per name
    return value
