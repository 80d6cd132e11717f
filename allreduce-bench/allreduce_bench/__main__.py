"""`python -m allreduce_bench`: nccl-tests-style collective benchmark, α–β fit, topology report.

The app lives in bench.py: spawned ranks unpickle `rank_fn` by module name, and a package's
__main__ is never re-imported in a child process.
"""

from dtrain.run.app import hydra_main

# named, not imported: a wrong override is refused before torch and the rank code load
# (dtrain.run.app.resolve)
main = hydra_main(
    "allreduce_bench.conf",
    rank_fn="allreduce_bench.bench:rank_fn",
    validate="allreduce_bench.checks:validate",
    finalize="allreduce_bench.bench:finalize",
)

if __name__ == "__main__":
    main()
