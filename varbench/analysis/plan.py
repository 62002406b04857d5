"""What an analysis will spend, decided before any work: the cost notice and ``--plan``.

Each analysis kind declares one pure function ``plan(tasks, config, vocab_size)`` computing its
sizes from its config (:mod:`varbench.analysis.kinds`; the variance analysis's sizes are
:func:`varbench.analysis.variance.sizes`); the analysis itself runs on the sizes that function
returns, so a notice printed from it is what the run samples.

Units: a *response* is one sampled completion of one prompt; a *pass* is one forward and
backward pass over one response (per-token gradients are taken response by response, batched
over its tokens), and one optimiser step over a batch counts one pass per response in it.
Cells already cached in the output directory are skipped, so a resumed run spends less.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """Responses and gradient passes of one analysis call on one policy (all prompts)."""

    analysis: str
    sampled: int
    """Responses sampled from the policy for the estimates (adaptive M: at its start)."""
    reference: int = 0
    """Responses sampled for a reference gradient (the variance analysis's sampled g*)."""
    enumerated: int = 0
    """Responses of an enumerated response space (the exact reference / response table):
    forward passes over all of them, gradients of at most all of them (counted in passes)."""
    passes: int = 0
    """Forward+backward passes (see the module docstring; adaptive M: at its start)."""
    max_sampled: int | None = None
    """Adaptive M: at most this many responses for the estimates (None: no growth)."""
    max_passes: int | None = None
    """Adaptive M: at most this many passes."""
    details: tuple[str, ...] = ()
    """How the sizes were decided, one clause each (e.g. a raised response floor)."""
    passes_at_most: bool = False
    """Whether ``passes`` is a bound (an exact reference takes gradients only of the enumerated
    responses with a nonzero reward)."""

    @property
    def total_sampled(self) -> int:
        """Every response sampled from the policy: estimates and reference."""
        return self.sampled + self.reference

    def times(self, n: int) -> Plan:
        """The plan of ``n`` such calls (one per policy state)."""
        def mul(x):
            return None if x is None else x * n
        return Plan(self.analysis, self.sampled * n, self.reference * n, self.enumerated * n,
                    self.passes * n, mul(self.max_sampled), mul(self.max_passes), self.details,
                    self.passes_at_most)

    def text(self, *, label: str | None = None) -> str:
        """One paragraph: responses sampled (reference and enumeration apart), passes, why."""
        who = f"{self.analysis}" + (f" ({label})" if label else "")
        parts = [f"{self.total_sampled:,} responses sampled"]
        if self.reference:
            parts[0] += (f" ({self.sampled:,} for the estimates + {self.reference:,} for the "
                         "sampled reference)")
        if self.max_sampled is not None and self.max_sampled > self.sampled:
            parts.append(f"up to {self.max_sampled + self.reference:,} if adaptive M grows "
                         "to its cap")
        if self.enumerated:
            parts.append(f"{self.enumerated:,} responses enumerated (exact)")
        passes = (f"{'at most ' if self.passes_at_most else ''}{self.passes:,} "
                  "forward+backward passes")
        if self.max_passes is not None and self.max_passes > self.passes:
            passes += f" (up to {self.max_passes:,})"
        parts.append(passes)
        why = f"; {'; '.join(self.details)}" if self.details else ""
        return f"{who}: {', '.join(parts)}{why}"
