"""Model parallelism shared by the trainer and the experiments.

    mesh.py       ParallelDims: pp x dp x tp degrees of every layout (dp = replicate x shard by
                  strategy), checked against world_size, one device mesh; the ZeRO stage run
    tp/           hand-rolled Megatron tensor parallelism (ops, comm, layers, attention),
                  tp/apply.py, which puts it into the shared GPT, and tp/dtensor_plan.py, the
                  same layouts through DTensor's parallelize_module
    pipeline.py   stage split of the GPT and torch.distributed.pipelining schedules
"""
