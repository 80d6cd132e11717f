"""dtrain: the shared launcher, metrics, model, data, timing, plots, cost model and guide."""
