"""Hand-rolled Megatron-style tensor parallelism (shared by the trainer and tp-attention).

ops.py        the conjugate autograd operators (copy/reduce, gather/scatter, SP)
tp_collectives.py  the collectives, counted and profiled, and the analytic volume they must equal
layers.py     ColumnParallelLinear / RowParallelLinear (+ async input-grad overlap)
attention.py  TensorParallelAttention / MLP / Block built from a dtrain.model.gpt Block
megatron.py   tensor-parallelize a whole GPT (apply_megatron_tp) for the trainer (DTensor
              parameters, so FSDP2 and DCP see global shapes)
dtensor_plan.py  the same layouts with parallelize_module (train.tp_impl=dtensor; the
              benchmark's DTensor baseline)
"""
