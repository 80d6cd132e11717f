"""allreduce-bench: nccl-tests-grade collective benchmarks over torch.distributed, a correctness
check, an α–β fit per collective and link class for the parallelism guide, and a topology report.

    spec.py        config -> checked plain values        busbw.py     bytes counted, bus factors
    collectives.py buffers, ops, correctness check       groups.py    link classes as sub-groups
    sweep.py       the timed loop (every rank)           fit.py       α–β least squares
    topology.py    nvidia-smi / ibstat parsers           linkspeed.py datasheet bandwidth per link
    topology_report.py  TOPOLOGY.md + topology facts     report.py    table, CSV, plots, fits
    bench.py       validate / rank_fn / finalize         __main__.py  `python -m allreduce_bench`
"""
