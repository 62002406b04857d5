"""varbench.analysis."""
