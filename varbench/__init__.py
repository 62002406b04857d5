"""varbench: gradient variance and credit assignment in RL fine-tuning of language models.

The public API is listed in ``__all__``; everything else is internal.
"""

from __future__ import annotations

__version__ = "0.1.0"

from varbench.rollout.batch import FlatBatch, RolloutBatch

__all__ = [
    "__version__",
    "FlatBatch",
    "RolloutBatch",
]
