"""dtrain: the shared launcher, metrics, model, data, timing, plots, cost model and guide."""
import os

# torch.profiler's kineto prints "USDT: ... profiler_start/stop" lines at its top log level (5) into every
# profiled run's output; 6 silences them (a profiler failure still raises in Python). Read when profiling starts.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
