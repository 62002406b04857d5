"""varbench.rollout."""
