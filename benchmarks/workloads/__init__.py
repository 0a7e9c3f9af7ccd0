"""One module per workload; each returns rows of a results table."""
