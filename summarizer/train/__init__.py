"""Layer 7, training: the loop, the run's session, validation, losses and the optimizer."""
