"""tp-attention: hand-rolled Megatron-style tensor-parallel attention, proven equal, benchmarked.

    ops.py               the conjugate autograd operators (copy/reduce, gather/scatter, SP)
    layers.py            ColumnParallelLinear / RowParallelLinear (+ async input-grad overlap)
    attention.py         TensorParallelAttention / MLP / Block built from a dtrain.model Block
    dtensor_baseline.py  the same layouts with parallelize_module, for comparison
    comm.py              the collectives, counted, and the analytic volume they must equal
    parity.py            `python -m tp_attention.parity`: equality with the single-device model
    bench.py, report.py  `python -m tp_attention`: timings, comm share, summary for the guide
"""
