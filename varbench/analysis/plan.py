"""What an analysis will spend, decided before any work: the cost notice and ``--plan``.

Each analysis kind declares one pure function ``plan(tasks, config, vocab_size)`` computing its
sizes from its config (:mod:`varbench.analysis.kinds`; the variance analysis's sizes are
:func:`varbench.analysis.variance.sizes`); the analysis itself runs on the sizes that function
returns, so a notice printed from it is what the run samples.

Units: a *response* is one sampled completion of one prompt; a *pass* is one forward and
backward pass over one response (per-token gradients are taken response by response, batched
over its tokens), and one optimiser step over a batch counts one pass per response in it.
Cells already cached in the output directory are skipped, so a resumed run spends less.

A gradient analysis also names the gradient *path* that runs (:func:`gradient_path`) and its
*response-uses* (a response in one group estimate of one coefficient set: scheme x mode x G),
and, when the model is known, the chunk plan of that path from the memory plan
(:func:`path_memory`: rows per forward of the projected path, cotangents per backward of the
vectors path), the plan the run itself chunks by.
"""

from __future__ import annotations

from dataclasses import dataclass

from varbench._util.checks import check_choice
from varbench.grads.chunking import shape_token_plan
from varbench.grads.seqnorms import sequence_plan
from varbench.models import memplan

GRADIENT_PATHS = ("projected", "vectors")


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
    path: str = ""
    """The gradient path that runs (:data:`GRADIENT_PATHS`; empty: not stated)."""
    uses: int = 0
    """Response-uses of the group estimates (responses x coefficient sets x group sizes)."""
    cell_passes: int = 0
    """The passes of the group estimates alone (``passes`` less the reference's and checks')."""
    memory: memplan.Plan | None = None
    """The path's chunk plan (None: the model is not known to the plan)."""

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
                    self.passes_at_most, self.path, self.uses * n, self.cell_passes * n,
                    self.memory)

    @property
    def passes_per_use(self) -> float:
        """Passes of the group estimates per response-use (NaN without uses)."""
        return self.cell_passes / self.uses if self.uses else float("nan")

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
        if self.path == "projected":
            parts.append(f"gradients: projected path, {self.cell_passes:,} passes for "
                         f"{self.uses:,} response-uses ({self.passes_per_use:.3g} per use)")
        elif self.path:  # a batched per-token backward is several forward+backwards' work
            parts.append(f"gradients: {self.path} path, {self.cell_passes:,} batched "
                         f"per-token backwards (one per response, its T cotangents) shared by "
                         f"{self.uses:,} response-uses")
        if self.memory is not None:
            parts.append(f"chunks: {self.memory.describe()}")
        why = f"; {'; '.join(self.details)}" if self.details else ""
        return f"{who}: {', '.join(parts)}{why}"


def gradient_path(requested: str, table: bool) -> str:
    """The path the group estimates take: ``requested`` (:data:`GRADIENT_PATHS`), except that
    groups drawn from an enumerated table always take the per-token vectors."""
    check_choice("gradients", requested, list(GRADIENT_PATHS))
    return "vectors" if table else requested


def path_memory(path: str, shape: memplan.ModelShape, B: int, L: int,
                free: int | None) -> memplan.Plan:
    """The chunk plan ``path`` runs ``B`` responses of ``L`` positions by, for a model of
    ``shape`` on a device with ``free`` bytes free before the model is loaded (None: not
    measured, the CPU): the projected path's rows per forward
    (:func:`varbench.grads.seqnorms.sequence_plan`, what ``response_sketches`` asks) or the
    vectors path's cotangents per batched backward (``token_vectors``' plan: half the memory
    fraction, :func:`varbench.grads.chunking.shape_token_plan`)."""
    from varbench.grads.chunking import MEMORY_FRACTION

    after = None if free is None else max(0, int(free) - shape.model_bytes)
    if path == "projected":
        return sequence_plan(shape, B, L, after)
    if path == "vectors":
        return shape_token_plan(shape, B, L, after, path="vectors",
                                memory_fraction=MEMORY_FRACTION / 2)
    check_choice("path", path, list(GRADIENT_PATHS))
    raise AssertionError(path)  # unreachable: check_choice raised
