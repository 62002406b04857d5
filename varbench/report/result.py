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
    """One headline number: ``value`` with standard error ``se`` and a sentence built from them."""

    key: str
    value: float
    se: float | None
    text: str
    unit: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "se": self.se, "unit": self.unit,
                "text": self.text}


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
