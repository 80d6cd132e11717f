"""`python -m allreduce_bench`: nccl-tests-style collective benchmark, α–β fit, topology report.

The app lives in bench.py: spawned ranks unpickle `rank_fn` by module name, and a package's
__main__ is never re-imported in a child process.
"""
from allreduce_bench.bench import finalize, rank_fn, validate
from dtrain.app import hydra_main

main = hydra_main("allreduce_bench.conf", rank_fn=rank_fn, validate=validate, finalize=finalize)

if __name__ == "__main__":
    main()
