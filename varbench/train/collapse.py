"""Collapse detection: a gradient-norm surge against a running median, or entropy collapse.

docs/science.md section 7: "a collapse shows first as a gradient-norm surge". A step is flagged

- ``grad_surge`` when its pre-clip gradient norm exceeds ``surge_factor`` times the median of
  the previous ``window`` steps' norms (at least ``min_history`` of them; the surging step
  itself joins the history afterwards, so one surge does not hide the next);
- ``entropy`` when the mean per-token entropy of the sampling policy falls below
  ``entropy_floor`` times its value at the first step seen.

The detector's state is a small JSON-able dict, saved in checkpoints so that a resumed run
flags exactly the steps an uninterrupted run would.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from varbench._util.checks import UsageError


class CollapseDetector:
    """Streaming collapse flags; call :meth:`update` once per training step."""

    def __init__(
        self,
        *,
        surge_factor: float = 5.0,
        window: int = 20,
        entropy_floor: float = 0.1,
        min_history: int = 5,
    ) -> None:
        if not surge_factor > 0:
            raise UsageError(f"surge_factor={surge_factor!r} is not valid; expected > 0")
        if window < 1 or min_history < 1:
            raise UsageError(f"window={window!r}, min_history={min_history!r}: expected >= 1")
        self.surge_factor = float(surge_factor)
        self.window = int(window)
        self.entropy_floor = float(entropy_floor)
        self.min_history = int(min_history)
        self.norms: list[float] = []
        self.entropy0: float | None = None

    def update(self, grad_norm: float, entropy: float) -> dict[str, int]:
        """Flags for this step: ``{"grad_surge": 0|1, "entropy": 0|1}``.

        Non-finite gradient norms count as a surge (and are not added to the history).
        """
        surge = 0
        history = self.norms[-self.window :]
        if not math.isfinite(grad_norm):
            surge = 1
        else:
            if len(history) >= self.min_history:
                med = statistics.median(history)
                surge = int(grad_norm > self.surge_factor * med)
            self.norms.append(float(grad_norm))
            self.norms = self.norms[-self.window :]
        collapsed = 0
        if math.isfinite(entropy):
            if self.entropy0 is None:
                self.entropy0 = float(entropy)
            collapsed = int(entropy < self.entropy_floor * self.entropy0)
        return {"grad_surge": surge, "entropy": collapsed}

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state (history and reference entropy)."""
        return {"norms": list(self.norms), "entropy0": self.entropy0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.norms = [float(x) for x in state["norms"]]
        self.entropy0 = None if state["entropy0"] is None else float(state["entropy0"])
