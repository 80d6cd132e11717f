"""Run infrastructure: `app` (hydra_main, run_app), `precheck`, `launch` (local spawn, Slurm, in a
job), `liveness`, `requeue`, `rundir` (run-dir ownership), `local_sweep`, `envinfo`, `hostload`,
`dist` (process groups, collective shims) and `selftest` (`python -m dtrain.run.selftest`)."""
