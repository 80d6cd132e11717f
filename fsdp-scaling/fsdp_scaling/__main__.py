"""`python -m fsdp_scaling`: one training run under one strategy, measured.

The per-rank code lives in fsdp_scaling.run (spawned ranks must import it by name: a package's
__main__ is not re-imported by multiprocessing).
"""
from dtrain.app import hydra_main
from fsdp_scaling.run import rank_fn, validate
from fsdp_scaling.summary import finalize

main = hydra_main("fsdp_scaling.conf", rank_fn=rank_fn, validate=validate, finalize=finalize)

if __name__ == "__main__":
    main()
