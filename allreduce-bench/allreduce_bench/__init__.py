"""allreduce-bench."""
