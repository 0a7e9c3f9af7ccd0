"""Benchmarks: every workload against every system, side by side in one run."""
