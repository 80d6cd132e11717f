"""Run infrastructure: `app` (hydra_main, run_app), `precheck`, `launch` (local spawn, Slurm, in a
job: `rank`, `local_launch`, `local_supervisor`, `slurm_launch`), `liveness` (with `interrupts`,
`job_watch`, `slurm_client_watch`, `rank_failure`), `requeue`, `rundir` (run-dir ownership),
`local_sweep`, `envinfo`, `hostload`,
`dist` (process groups, collective shims) and `selftest` (`python -m dtrain.run.selftest`)."""
