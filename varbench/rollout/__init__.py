"""varbench.rollout: sampling G responses per prompt into the [P, G, T] RolloutBatch."""

from varbench.rollout.batch import FlatBatch, RolloutBatch
from varbench.rollout.logprobs import response_logprobs
from varbench.rollout.sampler import (
    can_sample_differentiably,
    check_differentiable,
    encode_prompts,
    sample,
)

__all__ = ["FlatBatch", "RolloutBatch", "can_sample_differentiably", "check_differentiable",
           "encode_prompts", "response_logprobs", "sample"]
