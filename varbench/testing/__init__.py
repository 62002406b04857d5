"""varbench.testing."""
