"""Slurm: `queue` (will the request fit the partition; pending reasons that never clear), `jobs`
(jobs that left no complete run) and `submitit_sweep` (Hydra submitit sweeps: one-line refusal,
run dirs printed)."""
