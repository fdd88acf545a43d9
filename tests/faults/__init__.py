"""Fault injection across the floors: killed workers, non-finite numerics, full disks."""
