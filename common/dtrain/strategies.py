"""The shared trainer's data-parallel strategies: the one list (torch-free, so the cost model, the
guide and the contract import it without importing the trainer).

    single  one rank          ddp    replicated, all-reduce     zero2  FSDP2, params kept after forward
    zero3   FSDP2, resharded  hsdp   FSDP2 sharded in a node, replicated across (ZeRO-3 memory)
"""
from __future__ import annotations

ZERO_STAGE = {"single": 0, "ddp": 0, "zero2": 2, "zero3": 3, "hsdp": 3}  # what each strategy shards
STRATEGIES = tuple(ZERO_STAGE)
SHARDED = ("zero2", "zero3", "hsdp")  # built with FSDP2's fully_shard
# the strategy that runs a cost-model ZeRO stage (the trainer has no optimizer-only sharding)
STRATEGY_OF_ZERO = {0: "ddp", 1: "zero2", 2: "zero2", 3: "zero3"}
# train.activation_checkpointing <-> the cost model's recompute level (costmodel.shapes.RECOMPUTE): block
# checkpointing is "full"; Korthikanti's "selective" (the attention core) runs as whole blocks
RECOMPUTE_OF_CHECKPOINTING = {"none": "none", "op": "op", "block": "full"}
CHECKPOINTING_OF_RECOMPUTE = {"none": "none", "op": "op", "selective": "block", "full": "block"}
