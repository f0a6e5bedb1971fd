"""The parts every trainer shares: step, schedule, checkpoints, logging, loop."""
