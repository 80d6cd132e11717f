"""Model parallelism shared by the trainer and the experiments.

mesh.py       ParallelDims: pp x dp x tp degrees of every layout (dp = replicate x shard by
              strategy), checked against world_size, one device mesh; the ZeRO stage run
feasibility.py  what a layout cannot run, as one-line UserErrors, without torch
comm_counter.py the counter every hand-rolled collective reports to; one byte convention
traffic.py    bytes per collective per layer of each kind of traffic (no torch)
tp/           hand-rolled Megatron tensor parallelism (ops, tp_collectives, layers, attention),
              tp/megatron.py, which puts it into the shared GPT, and tp/dtensor_plan.py, the
              same layouts through DTensor's parallelize_module
cp/           context parallelism: zigzag shards, ring and all-to-all attention, the
              trainer's core swap (cp/trainer_cp.py)
ep/           expert parallelism: the uneven all-to-all dispatch / combine (ep/dispatch.py) and
              the trainer's experts sharded over ep (ep/trainer_ep.py)
pipeline.py   stage split of the GPT and torch.distributed.pipelining schedules
"""
