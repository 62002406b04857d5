"""varbench.estimators."""
