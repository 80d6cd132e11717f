"""Run results: `metrics` (RunWriter, summary.json), `loader` (finding and reading run
directories), `contract` (the typed guide inputs), `derived` (runs made from runs), `plots`.

    import dtrain.results
    frame = dtrain.results.load(paths)       # also load_runs, load_events

The loaders are imported on first use, so importing `dtrain.results.metrics` does not load pandas.
"""

__all__ = ["load", "load_events", "load_runs"]


def __getattr__(name: str):
    if name in __all__:
        from dtrain.results import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
