"""`python -m fsdp_scaling`: one training run under one strategy, measured.

The per-rank code lives in fsdp_scaling.run (spawned ranks must import it by name: a package's
__main__ is not re-imported by multiprocessing).
"""

from dtrain.run.app import hydra_main

# named, not imported: a wrong override is refused before torch and the rank code load
# (dtrain.run.app.resolve)
main = hydra_main(
    "fsdp_scaling.conf",
    rank_fn="fsdp_scaling.run:rank_fn",
    validate="fsdp_scaling.checks:validate",
    finalize="fsdp_scaling.summary:finalize",
)

if __name__ == "__main__":
    main()
