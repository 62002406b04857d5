"""varbench.train."""
