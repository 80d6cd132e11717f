"""Model parallelism shared by the trainer and the experiments.

    mesh.py       ParallelDims: dp x tp x pp degrees checked against world_size, one device mesh
    tp/           hand-rolled Megatron tensor parallelism (ops, comm, layers, attention) and
                  tp/apply.py, which puts it into the shared GPT
    pipeline.py   stage split of the GPT and torch.distributed.pipelining schedules
"""
