"""varbench.runner."""
