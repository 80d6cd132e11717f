"""DeepSpeed's pipeline engine (``Software.pipeline_engine`` "deepspeed": Megatron-DeepSpeed,
GPT-NeoX; MT-NLG and BLOOM ran it), priced from what the engine does, read from DeepSpeed's
runtime/pipe/schedule.py (TrainSchedule) and runtime/pipe/engine.py, p2p.py:

* TrainSchedule runs 2(m + p − 1) steps per batch; each step is a forward or a backward of one
  micro-batch (by the parity of step and stage), opened by its transfers: a forward step sends the
  previous micro-batch's input gradient back and receives this one's activation; a backward step
  receives this one's output gradient and sends the previous forward's activation on. The engine's
  p2p.send / p2p.recv are blocking (``async_op`` must be False): each transfer holds the stage's
  stream until its peer meets it, and none overlaps compute or batches with another.
* Played out (``simulate``, the reference), the compute alone costs (m + p − 1)·(f + b) on uniform
  stages, as Megatron's 1F1B (the bubble is priced the same), but the busiest stage's critical path
  crosses ``transfers(p, m)`` of those blocking transfers, 4m + 2(p − 4) for p ≥ 3 and m ≥ 2,
  where Megatron's batched send-and-receive pairs cross 2m (``traffic.pp_sends_per_step``).
* Activations and gradients travel partitioned over the TP ranks (engine.py ``pipe_partitioned``,
  ``grad_partitioned`` with model parallelism): the receiver rebuilds each one with an all-gather
  over TP before it computes (``PartitionedTensor.full``): two per micro-batch, on the stream.
* The flush: ReduceTiedGrads all-reduces a tied embedding's gradient between the first and the last
  stage, then ReduceGrads and OptimizerStep run after the last step (``Stack.dp_sync`` "flush",
  priced with the DP traffic).

* Its BF16_Optimizer (runtime/bf16_optimizer.py): DeepSpeed picks it for bf16 weights whose
  gradients accumulate in fp32 under ZeRO-0/1 (engine.py ``_do_optimizer_sanity_check``; BLOOM's
  training, where it was written: DeepSpeed issue 2352). Autograd leaves each micro-batch's
  gradients in bf16; after every backward the engine calls ``update_hp_grads``, which upcasts them
  (read 2, write 4) and adds them into the rank's full fp32 copy (read 4 + 4, write 4):
  ``HP_GRAD_BYTES`` per parameter of the stage, every micro-batch, at the add kernel's rate
  (``hp_grad_update_s``). Megatron fuses the same accumulation into the weight-gradient GEMM.

Not priced: the engine's Python per instruction (about 6 per step), whose launch cost no
measurement here gives for these machines.
"""

from __future__ import annotations

__all__ = [
    "ENGINES",
    "HP_GRAD_BYTES",
    "hp_grad_update_s",
    "schedule",
    "simulate",
    "step_to_micro_batch",
    "transfers",
]

ENGINES = ("megatron", "deepspeed")  # see Software.pipeline_engine


def step_to_micro_batch(step: int, stage: int, stages: int) -> tuple[int, bool]:
    """(micro-batch, forward?) of TrainSchedule's ``step`` on ``stage``: forward when step and
    stage have the same parity; the id may be out of range (an idle step)."""
    if step % 2 == stage % 2:
        return step // 2 - stage // 2, True
    if step % 2 == 0:  # odd stage
        return step // 2 - stages + (stage + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + stage // 2, False


def schedule(stage: int, stages: int, m: int) -> list[tuple[str, int, int]]:
    """TrainSchedule's instructions of one stage, in order: ("send" | "recv", peer stage, step) and
    ("F" | "B", micro-batch, step)."""
    out: list[tuple[str, int, int]] = []
    prev = -1
    for k in range(2 * (m + stages - 1)):
        mb, forward = step_to_micro_batch(k, stage, stages)
        now, before = 0 <= mb < m, 0 <= prev < m
        if forward and stage > 0:
            out += [("send", stage - 1, k)] if before else []  # SendGrad(prev)
            out += [("recv", stage - 1, k)] if now else []  # RecvActivation
        if not forward and stage < stages - 1:
            out += [("recv", stage + 1, k)] if now else []  # RecvGrad
            out += [("send", stage + 1, k)] if before else []  # SendActivation(prev)
        if now:
            out.append(("F" if forward else "B", mb, k))
        prev = mb
    return out


def simulate(stages: int, m: int, f: float, b: float, transfer: float) -> float:
    """Seconds of one batch through TrainSchedule: ``f``, ``b`` a micro-batch's forward and
    backward on a stage, ``transfer`` one blocking send/receive (it starts when both peers reach
    it and holds both). The reference ``transfers`` and the time model are checked against."""
    progs = [schedule(s, stages, m) for s in range(stages)]
    at, clock = [0] * stages, [0.0] * stages
    while any(at[s] < len(progs[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while at[s] < len(progs[s]):
                kind, peer, k = progs[s][at[s]]
                if kind in ("F", "B"):
                    clock[s] += f if kind == "F" else b
                elif at[peer] < len(progs[peer]) and progs[peer][at[peer]] == (
                    "recv" if kind == "send" else "send",
                    s,
                    k,
                ):
                    clock[s] = clock[peer] = max(clock[s], clock[peer]) + transfer
                    at[peer] += 1
                else:
                    break  # waits for its peer
                at[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("TrainSchedule deadlocked")  # never: the pairs match by step
    return max(clock)


def transfers(stages: int, m: int) -> int:
    """Blocking transfers on TrainSchedule's critical path for ``m`` micro-batches over ``stages``
    (``simulate``'s time grows by this many transfers): 4m + 2(p − 4) for p ≥ 3, 2m for p = 2
    (one neighbour), 2(p − 1) for one micro-batch (down and back), 0 without a pipeline."""
    if stages <= 1:
        return 0
    if m == 1:
        return 2 * (stages - 1)
    if stages == 2:
        return 2 * m
    return 4 * m + 2 * (stages - 4)


def engine_comm(stages: int, m: int, transfer: float, tp_gather: float, tied: float) -> float:
    """Seconds of a step's pipeline traffic on DeepSpeed's engine: ``transfers`` blocking sends
    and receives of ``transfer`` seconds each, 2 all-gathers over TP per micro-batch
    (``tp_gather``: rebuilding a partitioned activation or gradient; 0 without TP) and the flush's
    ReduceTiedGrads (``tied``: 0 without tied embeddings)."""
    if stages <= 1:
        return 0.0
    return transfers(stages, m) * transfer + 2 * m * tp_gather + tied


# BF16_Optimizer's update_hp_grads per parameter and micro-batch: lp.grad.to(fp32) reads 2 and
# writes 4 bytes, hp_grad.add_() reads 4 + 4 and writes 4 (see the module)
HP_GRAD_BYTES = 18.0


def hp_grad_update_s(stage_params: float, micro_batches: int, dev) -> float:
    """Seconds a step spends in BF16_Optimizer's ``update_hp_grads``: ``HP_GRAD_BYTES`` over the
    rank's ``stage_params`` (its gradients are not sharded: ZeRO-1 shards only the optimizer
    states) after each of the ``micro_batches`` backwards, at the add kernel's rate."""
    return micro_batches * dev.mem_s(HP_GRAD_BYTES * stage_params, "add")
