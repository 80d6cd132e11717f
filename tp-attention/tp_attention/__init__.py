"""tp-attention: hand-rolled Megatron-style tensor-parallel attention, proven equal, benchmarked.

(the layers themselves, ops/comm/layers/attention, live in dtrain.parallel.tp, shared
with the trainer)
(the DTensor baseline, the same layouts with parallelize_module, is dtrain.parallel.tp.dtensor_plan)
parity.py            `python -m tp_attention.parity`: equality with the single-device model
bench.py, report.py  `python -m tp_attention`: timings, comm share, summary for the guide
"""
