"""AnalysisResult: what every analysis returns and what the report layer renders.

Computation emits records (tidy pandas frames) plus headline figures with standard errors;
only ``varbench.report`` renders them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd


@dataclass
class Headline:
    """One headline number: ``value`` with standard error ``se`` and a sentence built from them.

    ``ci_lo``, ``ci_hi``, ``level``: the interval the sentence states (None where it states
    none), so that summary.json carries it as numbers, not only inside the text.
    """

    key: str
    value: float
    se: float | None
    text: str
    unit: str = ""
    ci_lo: float | None = None
    ci_hi: float | None = None
    level: float | None = None

    def __post_init__(self) -> None:
        from varbench.report.headline import has_interval

        if not has_interval(self.ci_lo, self.ci_hi):
            self.ci_lo = self.ci_hi = self.level = None
        else:
            self.ci_lo, self.ci_hi = float(self.ci_lo), float(self.ci_hi)
            self.level = 0.95 if self.level is None else float(self.level)

    @classmethod
    def from_dict(cls, h: dict[str, Any]) -> Headline:
        """The headline a :meth:`to_dict` wrote (a summary, a case cache)."""
        return cls(h["key"], h["value"], h.get("se"), h["text"], h.get("unit", ""),
                   h.get("ci_lo"), h.get("ci_hi"), h.get("level"))

    @property
    def degenerate_ci(self) -> bool:
        """Whether the text flags a degenerate interval (zero width, or from too few distinct
        replicates: :func:`~varbench.report.headline.interval_text`); read from the text, so a
        headline read back from a summary or a case cache keeps it."""
        from varbench.report.headline import DEGENERATE_CI

        return DEGENERATE_CI in self.text

    def to_dict(self) -> dict[str, Any]:
        out = {"key": self.key, "value": self.value, "se": self.se, "unit": self.unit,
               "text": self.text}
        if self.ci_lo is not None:  # only where an interval is stated
            out.update(ci_lo=self.ci_lo, ci_hi=self.ci_hi, level=self.level)
        if self.degenerate_ci:  # only when flagged: unflagged summaries stay as they were
            out["degenerate_ci"] = True
        return out


@dataclass
class AnalysisResult:
    """Records of one analysis run.

    ``kind``: "proxy" | "variance" | "cancellation" (selects the figures the report draws);
    ``records``: named tidy DataFrames; ``summary``: machine-readable scalars; ``headlines``:
    the headline numbers with SEs; ``config``: the full configuration; ``provenance``: versions,
    commit, device, seeds, wall time; ``notes``: generated caveat sentences for the report.
    """

    kind: str
    name: str
    records: dict[str, pd.DataFrame]
    summary: dict[str, Any] = field(default_factory=dict)
    headlines: list[Headline] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
