"""Optimizers, learning-rate schedules and mixed precision."""
