"""Collapse detection: a gradient-norm surge against a running median, or entropy collapse.

docs/science.md section 7: "a collapse shows first as a gradient-norm surge". A step is flagged

- ``grad_surge`` when its pre-clip gradient norm exceeds ``surge_factor`` times the median of
  the previous ``window`` steps' non-zero norms (at least ``min_history`` of them; the surging
  step itself joins the history afterwards, so one surge does not hide the next). A zero norm
  (every group's rewards agreed: no signal) is not a scale of the gradient and stays out of the
  history; otherwise a run of uninformative steps pulls the median towards 0 and the next
  ordinary step reads as a surge;
- ``entropy`` when the mean per-token entropy of the sampling policy falls below
  ``entropy_floor`` times its value at the first step seen.

The detector's state is a small JSON-able dict, saved in checkpoints so that a resumed run
flags exactly the steps an uninterrupted run would.

Calibration (:func:`calibrate`): the false-positive rate of a threshold is the fraction of runs
that did *not* collapse (judged by their outcome, e.g. held-out accuracy kept) that it flags at
least once. :func:`surge_scores` replays the detector over a recorded trace, so a threshold can
be chosen after the fact on recorded runs, and :func:`replay` gives the flags a threshold would
have raised.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
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

        Non-finite gradient norms count as a surge; neither they nor zero norms join the
        history.
        """
        surge = 0
        history = self.norms[-self.window :]
        if not math.isfinite(grad_norm):
            surge = 1
        else:
            if len(history) >= self.min_history:
                med = statistics.median(history)
                surge = int(grad_norm > self.surge_factor * med)
            if grad_norm > 0:
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


def surge_scores(grad_norms: Sequence[float], *, window: int = 20,
                 min_history: int = 5) -> list[float]:
    """Per step, the gradient norm over the running median the detector compares it with.

    ``grad_norms``: (steps,) one run's recorded pre-clip norms. A step is flagged at
    ``surge_factor`` f exactly when its score exceeds f (non-finite norms score inf; steps
    before ``min_history`` non-zero norms score 0). Same history rule as
    :class:`CollapseDetector`.
    """
    out, hist = [], []
    for g in grad_norms:
        g = float(g)
        if not math.isfinite(g):
            out.append(math.inf)
            continue
        h = hist[-window:]
        out.append(g / statistics.median(h) if len(h) >= min_history else 0.0)
        if g > 0:
            hist.append(g)
    return out


def replay(grad_norms: Sequence[float], entropies: Sequence[float], **params: Any) -> list[dict]:
    """The flags a :class:`CollapseDetector` with ``params`` raises over a recorded trace."""
    det = CollapseDetector(**params)
    return [det.update(float(g), float(e)) for g, e in zip(grad_norms, entropies, strict=True)]


def calibrate(traces: Sequence[Sequence[float]], *, target_fpr: float = 0.05,
              default: float = 5.0, window: int = 20, min_history: int = 5) -> dict[str, Any]:
    """Smallest surge factor that flags at most ``target_fpr`` of non-collapsing runs.

    ``traces``: gradient-norm traces of runs known *not* to have collapsed. A run's score is its
    largest :func:`surge_scores` value; a factor f flags the runs whose score exceeds f. Returns
    ``{"surge_factor", "fpr", "fpr_default", "runs", "scores"}``: the chosen factor (never below
    ``default``: calibration only makes the detector less sensitive), its false-positive rate on
    these runs (in-sample: check it on other runs) and the rate at ``default``. Non-finite norms
    are a collapse by definition and are not calibrated away (a run with one is an error here).
    """
    if not traces:
        raise UsageError("traces is empty; calibration needs at least one non-collapsing run")
    scores = [max(surge_scores(t, window=window, min_history=min_history), default=0.0)
              for t in traces]
    if any(not math.isfinite(s) for s in scores):
        raise UsageError("a calibration trace has a non-finite gradient norm: that run collapsed")
    n = len(scores)
    allowed = math.floor(target_fpr * n + 1e-9)  # runs that may stay flagged
    ranked = sorted(scores, reverse=True)
    need = ranked[allowed] if allowed < n else 0.0  # flag only scores strictly above this
    factor = max(float(default), float(need))
    return {"surge_factor": factor, "fpr": sum(s > factor for s in scores) / n,
            "fpr_default": sum(s > default for s in scores) / n, "runs": n, "scores": scores}
