"""Runs that survive faults: elastic training and test-only fault injection."""
