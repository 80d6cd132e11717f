"""Bytes each kind of parallel traffic moves, per collective per layer: the formulas' one home.

Both sides call these functions: the trainer's counted-bytes checks (the `expected_wire_bytes`
of `tp.tp_collectives` and `cp.exchange` are `tp_layer_wire_bytes` and `cp_layer_wire_bytes`,
compared with what a `CommCounter` counts) and the cost model (`costmodel/comm_time.py`,
`timemodel.StepModel`), which prices each collective's bytes with its α–β
(`costmodel/collectives.py`). No torch here, so the cost model imports it without torch.

Volume convention: bytes one rank sends over the wire with ring algorithms (nccl-tests' "bus
bytes"). For a payload of S bytes over n ranks (S = the full, gathered size; for all-to-all the
rank's whole input):

    all-reduce 2(n-1)/n * S     all-gather, reduce-scatter, all-to-all (n-1)/n * S     send S

so sequence parallelism (all-gather + reduce-scatter) moves exactly what all-reduce moves.

    TP / SP   tp_activation_bytes, tp_collectives_per_layer, tp_grad_sync_bytes, tp_kv_heads
    CP        ring_kv_block_bytes, ring_sends_per_layer; ulysses_kv_heads,
              ulysses_all_to_all_payloads, ulysses_passes; cp_all_gather_kv_bytes (PyTorch's)
    DP        dp_grad_bytes, zero_gather_bytes, hsdp_replica_bytes, LOSS_BYTES
    PP        pp_activation_bytes, pp_sends_per_step
"""

from __future__ import annotations

import math

# TP's tags: per micro-batch traffic vs per-step grad sums
ACTIVATION, GRAD_SYNC = "activation", "grad_sync"
LOSS_BYTES = 4  # the step's fp32 loss, all-reduced over DP for the log


def wire_bytes(op: str, payload_bytes: int, n: int) -> int:
    """Bytes one rank sends for `op` among n ranks (see the module docstring)."""
    if op == "send":  # point to point: the payload itself
        return payload_bytes
    factor = 2 if op == "all_reduce" else 1
    return factor * (n - 1) * payload_bytes // n


# ---------------------------------------------------------------- tensor / sequence parallel


def tp_kv_heads(n_kv_head: int, tp: int) -> int:
    """k/v heads a TP rank attends with: n_kv_head / tp, or one (replicated) when tp > n_kv_head."""
    return max(n_kv_head // tp, 1)


def tp_activation_bytes(batch: int, seq: int, d_model: int, elem_bytes: int) -> int:
    """Payload of each TP collective: a region's b·s·h activation (the all-reduce's tensor; SP's
    all-gather output and reduce-scatter input)."""
    return batch * seq * d_model * elem_bytes


def tp_collectives_per_layer(
    recompute: str = "none", sequence_parallel: bool = False, regions: int = 2
) -> int:
    """All-reduces (or SP all-gather + reduce-scatter pairs) of one layer's forward + backward: each
    TP region (attention; the MLP in a block) enters and leaves once per pass (Shoeybi et al. 2019
    §3). Full recompute runs the forward's again; selective op AC re-runs wo and the all-reduce
    after it, except with SP, whose reduce-scatter output torchtitan's policy saves."""
    again = {"full": regions, "op": 0 if sequence_parallel else 1}.get(recompute, 0)
    return 2 * regions + again


def tp_grad_sync_bytes(
    *,
    d_model: int,
    n_head: int,
    n_kv_head: int,
    tp: int,
    sequence_parallel: bool,
    module: str = "block",
    norm: str = "rmsnorm",
    bias: bool = False,
    elem_bytes: int = 4,
) -> int:
    """Payload of the one all-reduce of the replicated parameters whose grads are partial sums:
    with SP the norm weights, LayerNorm biases and row-parallel biases; with kv_heads < tp the
    whole wk and wv (+ biases) every rank holds."""
    regions = 2 if module == "block" else 1
    partial = 0  # elements
    if sequence_parallel and tp > 1:
        norms = 2 if module == "block" else 0
        per_norm = d_model * (2 if norm == "layernorm" and bias else 1)
        partial += norms * per_norm + (regions * d_model if bias else 0)
    if n_kv_head < tp:
        partial += 2 * n_kv_head * (d_model // n_head) * (d_model + bias)
    return partial * elem_bytes


def tp_layer_wire_bytes(
    *,
    batch: int,
    seq: int,
    d_model: int,
    n_head: int,
    n_kv_head: int,
    tp: int,
    sequence_parallel: bool,
    module: str = "block",
    norm: str = "rmsnorm",
    bias: bool = False,
    elem_bytes: int = 4,
) -> dict[str, int]:
    """Wire bytes per rank of one TP layer's forward + backward, by tag (ACTIVATION, GRAD_SYNC)."""
    regions = 2 if module == "block" else 1
    act = tp_activation_bytes(batch, seq, d_model, elem_bytes)
    n = tp_collectives_per_layer(regions=regions)
    if sequence_parallel:
        one = wire_bytes("all_gather", act, tp) + wire_bytes("reduce_scatter", act, tp)
    else:
        one = wire_bytes("all_reduce", act, tp)
    grads = tp_grad_sync_bytes(
        d_model=d_model,
        n_head=n_head,
        n_kv_head=n_kv_head,
        tp=tp,
        sequence_parallel=sequence_parallel,
        module=module,
        norm=norm,
        bias=bias,
        elem_bytes=elem_bytes,
    )
    return {ACTIVATION: n * one, GRAD_SYNC: wire_bytes("all_reduce", grads, tp)}


# ---------------------------------------------------------------- context parallel


def ring_kv_block_bytes(
    batch: int, seq: int, cp: int, n_kv_head: int, head_dim: int, elem_bytes: int
) -> int:
    """One ring send: the k and v of a rank's s/cp tokens, 2·b·(s/cp)·n_kv·hd values (also the
    size of a k/v gradient block)."""
    return 2 * batch * (seq // cp) * n_kv_head * head_dim * elem_bytes


def ring_sends_per_layer(cp: int, recompute: str = "none") -> int:
    """Ring sends of one layer's forward + backward: cp-1 k/v blocks forward, cp-1 k/v blocks and
    cp-1 gradient blocks backward; full recompute runs the forward's again."""
    return (3 + (recompute == "full")) * (cp - 1)


def cp_all_gather_kv_bytes(
    batch: int, seq: int, cp: int, n_heads: int, head_dim: int, elem_bytes: int
) -> int:
    """PyTorch's context_parallel: the gathered k and v of all cp ranks (the all-gather's output),
    `n_heads` per token as its SDPA gets them."""
    return cp * ring_kv_block_bytes(batch, seq, cp, n_heads, head_dim, elem_bytes)


def ulysses_kv_heads(n_kv_head: int, cp: int) -> int:
    """k/v heads Ulysses spreads over cp ranks: n_kv_head, or each repeated up to lcm(n_kv_head, cp)
    when cp does not divide it (every rank needs the k/v heads its query heads read)."""
    return n_kv_head if n_kv_head % cp == 0 else math.lcm(n_kv_head, cp)


def ulysses_all_to_all_payloads(
    batch: int, seq: int, cp: int, n_head: int, n_kv_head: int, head_dim: int, elem_bytes: int
) -> tuple[int, int, int, int]:
    """The rank's input to each all-to-all of one pass (q, k, v, out; backward: their gradients):
    b·(s/cp)·heads·hd, k and v with their heads repeated to `ulysses_kv_heads`."""
    local = batch * (seq // cp) * head_dim * elem_bytes
    kv = local * ulysses_kv_heads(n_kv_head, cp)
    return local * n_head, kv, kv, local * n_head


def ulysses_passes(recompute: str = "none") -> int:
    """Passes of the four all-to-alls per layer: forward, backward, and the recompute's forward."""
    return 2 + (recompute == "full")


def cp_layer_wire_bytes(
    impl: str,
    *,
    batch: int,
    seq: int,
    n_head: int,
    n_kv_head: int,
    head_dim: int,
    cp: int,
    elem_bytes: int = 4,
) -> int:
    """Bytes one rank sends for one attention layer's forward + backward (s = the whole sequence):
    the ring's sends of k/v blocks, or Ulysses' all-to-alls, each (cp-1)/cp of its payload."""
    if impl == "ring":
        block = ring_kv_block_bytes(batch, seq, cp, n_kv_head, head_dim, elem_bytes)
        return ring_sends_per_layer(cp) * wire_bytes("send", block, cp)
    if impl == "ulysses":
        pieces = ulysses_all_to_all_payloads(
            batch, seq, cp, n_head, n_kv_head, head_dim, elem_bytes
        )
        return ulysses_passes() * sum(wire_bytes("all_to_all", p, cp) for p in pieces)
    raise ValueError(f"unknown cp impl {impl!r}")


# ---------------------------------------------------------------- data parallel / ZeRO


def dp_grad_bytes(params: float, grad_bytes: int) -> float:
    """Gradient bytes reduced over DP per step (all-reduce, or ZeRO's reduce-scatter input)."""
    return grad_bytes * params


def zero_gather_bytes(params: float, value_bytes: int, kept_params: float | None = None) -> float:
    """Weight bytes ZeRO / FSDP all-gathers (the gathered output). FP8 weight gathers: give
    `kept_params`, those still moved at `value_bytes` (the embedding matrices); the rest (the
    block linears) move 1 byte each."""
    if kept_params is None:
        return value_bytes * params
    return (params - kept_params) + value_bytes * kept_params


def hsdp_replica_bytes(grad_bytes_total: float, shard_group: int) -> float:
    """HSDP: the gradient shard each rank all-reduces across the replicas."""
    return grad_bytes_total / shard_group


# ---------------------------------------------------------------- pipeline parallel


def pp_activation_bytes(
    batch: int, seq: int, d_model: int, elem_bytes: int, cp: int = 1, tp: int = 1
) -> float:
    """One p2p activation (or its gradient) between stages: b·(s/cp)·h values, scattered over the
    tp ranks (Megatron's scatter/gather, Narayanan et al. 2021 §4.1)."""
    return batch * seq // cp * d_model * elem_bytes / tp


def pp_sends_per_step(virtual_stages: int, micro_batches: int) -> int:
    """Activation sends and gradient sends of a stage per step: one each per virtual chunk and
    micro-batch."""
    return 2 * virtual_stages * micro_batches


# ---------------------------------------------------------------- expert parallel (MoE)


def ep_dispatch_bytes(tokens: float, top_k: int, d_model: int, elem_bytes: float) -> float:
    """A rank's dispatch all-to-all input: each of its ``tokens`` sent to its top_k experts, a
    d_model row each (the combine's output has the same size, at the combine's element bytes)."""
    return tokens * top_k * d_model * elem_bytes


def ep_layer_bytes(
    tokens: float, top_k: int, d_model: int, ep: int, dispatch_bytes: float, combine_bytes: float
) -> float:
    """Wire bytes one rank sends per MoE layer and micro-batch, forward + backward, with an
    all-to-all dispatcher: 2·(b_dispatch + b_combine)·T·k·h·(ep−1)/ep (forward dispatch and
    combine, backward their gradients; the (ep−1)/ep share leaves the rank). FP8 dispatch
    (``dispatch_bytes`` 1) halves the first term."""
    per = tokens * top_k * d_model * (ep - 1) / ep
    return 2 * (dispatch_bytes + combine_bytes) * per


def ep_nodes_reached(top_k: int, nodes: int, node_limit: int | None = None) -> float:
    """Distinct nodes a token's top_k experts sit on, uniform routing over ``nodes`` nodes:
    nodes·(1 − (1 − 1/nodes)^k), at most ``node_limit`` (DeepSeek-V3's node-limited routing: 4).
    DeepEP's internode dispatch sends a token once per target node, then forwards it over
    NVLink (DeepEP README)."""
    if nodes <= 1:
        return 1.0
    reached = nodes * (1 - (1 - 1 / nodes) ** top_k)
    return min(reached, node_limit) if node_limit else reached
