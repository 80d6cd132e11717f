"""dtrain, by layer (docs/ARCHITECTURE.md, "Packages" and "Layers"): the base (`core`, `run`,
`slurm`, `model`, `results`, `conf`), then `parallel`, `costmodel`, `train`, and on top `guide`,
`gpucheck`, `cli`."""

import os

# torch.profiler's kineto prints "USDT: ... profiler_start/stop" lines at its top log level (5) into
# every profiled run's output; 6 silences them (a profiler failure still raises in Python). Read
# when profiling starts.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
