"""PARALLELISM_GUIDE.md: the decision matrix, its rules, calibration and checks, rendered from
results."""
