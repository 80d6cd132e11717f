"""Ring attention (pass-KV), causal, on zigzag shards: each rank keeps its queries and the k/v
blocks travel round the ring.

Step i of cp: this rank's queries meet the k/v block that started on rank src = (r - i) mod cp,
while that block is already on its way to rank r+1 for step i+1 (`overlap`: the send runs under
the compute). Each step gives a partial result over some keys, (out_i, lse_i) with lse the
log-sum-exp of a query's scores; `merge_partials` folds it in with the online softmax:

    lse = log(e^lse + e^lse_i),   out = e^(lse_old - lse)·out + e^(lse_i - lse)·out_i

With zigzag shards (sharding.py: chunks r and 2cp-1-r) `block_plan` skips what the causal mask
hides, and every rank does the same work: its own block causally, then per step half a block
(all queries vs an earlier rank's first chunk, or the later local chunk vs a later rank's block).

Backward (a custom autograd.Function) walks the ring again: the softmax is recomputed from the
saved lse (FlashAttention's backward: P = e^(S - lse), dS = P·(dP - rowsum(dO·O))), and the
gradient of each k/v block travels behind it, every rank adding its part, until it reaches the
rank that owns the block. Computed in fp32 (the merge needs it), autocast off; a block is the
explicit math of `block_attention_math` / `block_grads_math`, or on CPU PyTorch's fused
flash-attention kernel, which returns the lse too. GQA: k/v carry fewer heads on the wire; each
query head reads k/v head h // (n_head / n_kv).
"""

from __future__ import annotations

import torch

from dtrain.parallel.comm_counter import group_size
from dtrain.parallel.cp import exchange


def merge_partials(out, lse, block_out, block_lse):
    """Online softmax: two partial attentions over disjoint keys -> the attention over both."""
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(
        block_lse - new
    ).unsqueeze(-1), new


def block_plan(rank: int, src: int, length: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of this rank's `length` local tokens that meet the block
    from rank `src` (zigzag: each rank holds an early and a late chunk, half the tokens each)."""
    half = length // 2
    if src == rank:  # own chunks: the local order is increasing, so the plain causal triangle
        return slice(None), slice(None), True
    if src < rank:  # its early chunk precedes both local chunks; its late chunk follows them
        return slice(None), slice(0, half), False
    return (
        slice(half, None),
        slice(None),
        False,
    )  # both its chunks lie between ours: our late chunk sees them


def _expand(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


def _fold(g: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of `_expand`: sum over the query heads that shared a k/v head."""
    if n_rep == 1:
        return g
    b, h, t, d = g.shape
    return g.view(b, h // n_rep, n_rep, t, d).sum(2)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        hidden = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


def block_attention_math(q, k, v, causal: bool, scale: float):
    """softmax(q·kᵀ·scale)·v over one block of keys, and each query's log-sum-exp."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def block_grads_math(q, k, v, out, lse, dout, causal: bool, scale: float):
    """dq, dk, dv of one block, given the final out and lse of its queries."""
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - (dout * out).sum(-1, keepdim=True))
    return (
        torch.matmul(ds, k) * scale,
        torch.matmul(ds.transpose(-2, -1), q) * scale,
        torch.matmul(p.transpose(-2, -1), dout),
    )


# On CPU PyTorch's fused flash-attention kernel returns the lse too, and its backward takes any
# (out, lse): the same two functions, ~4x faster (the study times the ring against fused SDPA).
def block_attention(q, k, v, causal: bool, scale: float):
    if q.device.type != "cpu":
        return block_attention_math(q, k, v, causal, scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )[:2]


def block_grads(q, k, v, out, lse, dout, causal: bool, scale: float):
    if q.device.type != "cpu":
        return block_grads_math(q, k, v, out, lse, dout, causal, scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale
    )


def _walk_ring(k, v, group, overlap: bool, n_rep: int, length: int):
    """Each step's (step, query rows, key rows, causal, k block, v block) on this rank, the k/v
    block already on its way to the next rank while the step computes (overlap=False: delivered
    first)."""
    cp, rank = group_size(group), exchange.rank_in(group)
    kv = torch.stack([k, v])  # what travels, in the input dtype
    for step in range(cp):
        pending = exchange.ring_exchange(kv, group, exchange.KV) if step + 1 < cp else None
        if pending is not None and not overlap:
            pending.wait()
        rows, keys, causal = block_plan(rank, (rank - step) % cp, length)
        yield (step, rows, keys, causal, *(_expand(t[:, :, keys].float(), n_rep) for t in kv))
        if pending is not None:
            kv = pending.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, overlap, merge):
        n_rep, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
        with torch.autocast(q.device.type, enabled=False):
            q32, out, lse = q.float(), None, None
            for step, rows, keys, causal, k_blk, v_blk in _walk_ring(
                k, v, group, overlap, n_rep, q.shape[2]
            ):
                block_out, block_lse = block_attention(q32[:, :, rows], k_blk, v_blk, causal, scale)
                if out is None:
                    out, lse = block_out, block_lse
                else:
                    out[:, :, rows], lse[:, :, rows] = merge(
                        out[:, :, rows], lse[:, :, rows], block_out, block_lse
                    )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.overlap = group, overlap
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        n_rep, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
        with torch.autocast(q.device.type, enabled=False):
            q32, dout = q.float(), dout.float()
            dq = torch.zeros_like(q32)
            home = travelling = (
                None  # this rank's own block's gradient; the gradient exchange in flight
            )
            for step, rows, keys, causal, k_blk, v_blk in _walk_ring(
                k, v, ctx.group, ctx.overlap, n_rep, q.shape[2]
            ):
                dq_b, dk_b, dv_b = block_grads(
                    q32[:, :, rows],
                    k_blk,
                    v_blk,
                    out[:, :, rows],
                    lse[:, :, rows],
                    dout[:, :, rows],
                    causal,
                    scale,
                )
                dq[:, :, rows] += dq_b
                dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
                dkv[0][:, :, keys], dkv[1][:, :, keys] = _fold(dk_b, n_rep), _fold(dv_b, n_rep)
                if step == 0:
                    home = dkv
                else:  # add to what the ranks before added to this block's gradient, pass it on
                    if travelling is not None:
                        dkv += travelling.wait()
                    travelling = exchange.ring_exchange(dkv, ctx.group, exchange.KV_GRAD)
                    if not ctx.overlap:
                        travelling.wait()
            if travelling is not None:  # the last hop brings this rank's own block's gradient home
                home = home + travelling.wait()
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    *,
    overlap: bool = True,
    merge=merge_partials,
) -> torch.Tensor:
    """Causal attention of this rank's zigzag shard: q (B, n_head, s/cp, hd), k and v
    (B, n_kv, s/cp, hd) -> (B, n_head, s/cp, hd). `overlap=False` waits for each send before the
    compute it could hide behind (the study's serial baseline); `merge` is swappable so a test
    can plant a wrong one."""
    return _RingAttention.apply(q, k, v, group, overlap, merge)
