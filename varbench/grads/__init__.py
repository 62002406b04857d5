"""varbench.grads."""
