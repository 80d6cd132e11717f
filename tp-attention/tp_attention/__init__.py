"""tp-attention: hand-rolled Megatron-style tensor-parallel attention, proven equal, benchmarked.

    (the layers themselves, ops/comm/layers/attention, live in dtrain.parallel.tp, shared
    with the trainer)
    dtensor_baseline.py  the same layouts with parallelize_module, for comparison
    parity.py            `python -m tp_attention.parity`: equality with the single-device model
    bench.py, report.py  `python -m tp_attention`: timings, comm share, summary for the guide
"""
