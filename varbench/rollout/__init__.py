"""varbench.rollout: sampling G responses per prompt into the [P, G, T] RolloutBatch."""

from varbench.rollout.batch import FlatBatch, RolloutBatch
from varbench.rollout.sampler import sample

__all__ = ["FlatBatch", "RolloutBatch", "sample"]
