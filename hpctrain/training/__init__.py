"""Training: the run's configuration, its plan (what runs where), one step, and the run loop over steps."""
