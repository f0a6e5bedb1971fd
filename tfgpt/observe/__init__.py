"""What a run shows of itself: the monitor, FLOPs and MFU, profiling, the reporter."""
