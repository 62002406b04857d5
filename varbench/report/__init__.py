"""varbench.report."""
