"""Context parallelism in the trainer (`train.cp`, `train.cp_impl`): the cp ranks of a replica
share each sequence, each holding its zigzag shard (sharding.py) with the tokens' global positions
(what cannot run: dtrain.parallel.feasibility).

    select_impl(requested, device_type, backend)         which implementation a run uses
    swap_attention_cores(part, impl, mesh)               every attention's core -> ring / all-to-all
    ContextParallel.batch(x, y)                          a micro-batch as this rank sees it

Implementations: `torch` is PyTorch's `context_parallel` (it patches SDPA with its ring attention
and shards the batch itself; it needs the fused CUDA SDPA kernels, so CUDA + NCCL), `ring` and
`ulysses` are this package's, which run anywhere (gloo on CPU included). `auto` takes torch where
it runs, else ring; the run records which (`cp_impl` in its summary).
"""

from __future__ import annotations

import contextlib

import torch

from dtrain.core.errors import UserError
from dtrain.parallel.cp import sharding


def select_impl(requested: str, device_type: str, backend: str) -> str:
    """`auto` -> torch on CUDA with NCCL, else ring; anything else as asked."""
    if requested != "auto":
        return requested
    return "torch" if device_type == "cuda" and backend == "nccl" else "ring"


class ContextParallelCore:
    """The attention math over the cp group, with dtrain.model.gpt.causal_attention's signature
    (projections (B, s/cp, heads·hd) in, the same shape out), so it replaces the core of a
    dtrain.model.gpt Attention or of a tensor-parallel shard of one. `ring_options` go to
    ring.ring_attention (the study's serial baseline, a test's planted bug)."""

    def __init__(self, impl: str, group, **ring_options):
        self.impl, self.group, self.ring_options = impl, group, ring_options

    def __call__(self, q, k, v, head_dim: int):
        from dtrain.parallel.cp.ring import ring_attention
        from dtrain.parallel.cp.ulysses import ulysses_attention

        b, t, _ = q.shape
        q, k, v = (x.view(b, t, -1, head_dim).transpose(1, 2) for x in (q, k, v))
        if self.impl == "ring":
            y = ring_attention(q, k, v, self.group, **self.ring_options)
        else:
            y = ulysses_attention(q, k, v, self.group)
        return y.transpose(1, 2).reshape(b, t, -1)

    def __deepcopy__(self, memo):  # a process group cannot be copied; the core holds no state
        return self


def swap_attention_cores(part: torch.nn.Module, impl: str, mesh) -> int:
    """Give every attention of `part` the cp core (torch: keep SDPA, which context_parallel
    patches). Every attention must still run dtrain.model.gpt's SDPA core: anything else is refused.
    Returns
    the number of attention layers."""
    from dtrain.model.gpt import causal_attention

    attentions = [(name, m) for name, m in part.named_modules() if hasattr(m, "core")]
    other = [(name, m.core) for name, m in attentions if m.core is not causal_attention]
    if other or not attentions:
        where = (
            f"{other[0][0]} runs {other[0][1]!r}"
            if other
            else "the model has no dtrain.model.gpt attention"
        )
        raise UserError(
            f"train.cp needs dtrain.model.gpt's SDPA attention in every block, but {where}: use "
            "train.cp=1"
        )
    if impl != "torch":
        for _, m in attentions:
            m.core = ContextParallelCore(impl, mesh.get_group())
    return len(attentions)


class ContextParallel:
    """The batch side: each micro-batch's tokens and positions on this cp rank."""

    def __init__(self, impl: str, mesh, seq_len: int, device: torch.device):
        self.impl, self.mesh = impl, mesh
        self.cp, self.rank = mesh.size(), mesh.get_local_rank()
        self.positions = sharding.positions(seq_len, self.cp, self.rank, device)

    @contextlib.contextmanager
    def batch(self, x: torch.Tensor, y: torch.Tensor):
        """(x, y, positions) of this rank; forward and backward run inside (torch's context_parallel
        patches SDPA only while it is open)."""
        if self.impl != "torch":
            yield (
                sharding.shard(x, self.cp, self.rank),
                sharding.shard(y, self.cp, self.rank),
                self.positions,
            )
            return
        from torch.distributed.tensor.experimental import context_parallel

        positions = torch.arange(x.shape[1], device=x.device)
        buffers = [x, y, positions]  # sharded in place, with the same head-tail (zigzag) layout
        with context_parallel(
            self.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(buffers)
        ):
            yield x, y, positions
