"""varbench.tasks."""
