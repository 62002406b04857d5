"""varbench.models."""
