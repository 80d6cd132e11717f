"""The MoE feed-forward of dtrain's GPT (``model.moe.experts`` > 0; configuration and parameter /
FLOP terms in dtrain.model.moe_args), in torchtitan's shape: a router, grouped experts, optional
shared experts, and a dispatcher that expert parallelism replaces (dtrain.parallel.ep).

Module names: ``blocks.{i}.mlp.router.gate`` (d -> E, no bias), ``blocks.{i}.mlp.experts.{w1,w2}``
((E, d, f) and (E, f, d): one tensor per weight, so expert parallelism shards dimension 0),
``blocks.{i}.mlp.shared.{w1,w2}`` (the shared experts as one MLP), and the buffer
``router.expert_bias`` (the sigmoid router's selection bias, trained by the bias update, not by
gradients).

Forward of one MoE layer on N tokens: route (top_k experts and weights per token), drop what is
over capacity (capacity_factor set), sort the kept (token, expert) assignments by expert, run the
experts on the sorted rows (``dispatcher``: locally, or all-to-all over the ep group and back),
scatter-add each row times its weight into its token. Every layer counts the assignments each
expert received (``tokens_per_expert``), the dropped ones and the busiest ep rank's rows, summed
over the step's micro-batches until ``take_stats`` (the trainer's MoE metrics, dtrain.train.moe).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtrain.model.moe_args import MoEArgs


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """torch._grouped_mm's fast path: CUDA compute capability 9.0+ (Hopper's grouped GEMM), bf16."""
    return (
        hasattr(torch, "_grouped_mm")
        and device.type == "cuda"
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def _act(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h, approximate="tanh")  # the dense MLP's activation


def experts_loop(x: torch.Tensor, counts: list[int], w1, w2) -> torch.Tensor:
    """The reference: rows of x sorted by expert, counts[e] rows for expert e; one GEMM pair per
    expert."""
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append(_act(x[start : start + n] @ w1[e]) @ w2[e])
        start += n
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[-1])


def experts_padded(x: torch.Tensor, counts: list[int], w1, w2) -> torch.Tensor:
    """The grouped GEMM emulated in plain torch: each expert's rows padded to the largest group,
    one batched matmul per weight, the padding dropped (the same math as one grouped GEMM)."""
    E, width = len(counts), max(counts, default=0)
    if width == 0:
        return x.new_zeros(0, w2.shape[-1])
    counts_t = torch.tensor(counts, device=x.device)
    expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts_t)
    starts = torch.cumsum(counts_t, 0) - counts_t
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
    padded = x.new_zeros(E, width, x.shape[1])
    padded[expert, slot] = x
    h = torch.bmm(_act(torch.bmm(padded, w1)), w2)
    return h[expert, slot]


def experts_grouped(x: torch.Tensor, counts: list[int], w1, w2) -> torch.Tensor:
    """One grouped GEMM per weight: torch._grouped_mm(2-D rows, 3-D weights, offs = the groups'
    cumulative ends, int32)."""
    offs = torch.cumsum(
        torch.tensor(counts, device=x.device, dtype=torch.int32), 0, dtype=torch.int32
    )
    h = _act(torch._grouped_mm(x, w1, offs=offs))
    return torch._grouped_mm(h, w2, offs=offs)


GEMM_IMPLS = {"loop": experts_loop, "padded": experts_padded, "grouped": experts_grouped}


class GroupedExperts(nn.Module):
    """E experts (GELU MLPs of width f) as two (E, ., .) weights; expert parallelism keeps a
    slice of dimension 0 on each rank (``num_local``)."""

    def __init__(self, experts: int, d_model: int, ffn: int, gemm: str = "auto"):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, d_model, ffn))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, d_model))
        self.gemm = gemm

    @property
    def num_local(self) -> int:
        return self.w1.shape[0]

    def impl(self, x: torch.Tensor) -> str:
        if self.gemm != "auto":
            return self.gemm
        return "grouped" if grouped_mm_supported(x.device, x.dtype) else "loop"

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2 = self.w1, self.w2
        if hasattr(w1, "to_local"):  # expert parallelism: this rank's experts (dtrain.parallel.ep)
            w1, w2 = w1.to_local(), w2.to_local()
        return GEMM_IMPLS[self.impl(x)](x, counts, w1.to(x.dtype), w2.to(x.dtype))


class Router(nn.Module):
    """Top-k routing: (N, d) tokens -> expert ids (N, k), weights (N, k), the softmax
    probabilities (N, E) for Switch's auxiliary loss (None without it)."""

    def __init__(self, moe: MoEArgs, d_model: int, make_linear, prefix: str):
        super().__init__()
        self.moe = moe
        self.gate = make_linear(f"{prefix}.gate", d_model, moe.experts, False)
        # DeepSeek-V3's selection bias (sigmoid router): a buffer, updated from the load
        self.register_buffer("expert_bias", torch.zeros(moe.experts), persistent=True)

    def forward(self, x: torch.Tensor):
        logits = self.gate(x).float()  # routing in fp32, whatever the compute precision
        k = self.moe.top_k
        if self.moe.router == "sigmoid":
            scores = torch.sigmoid(logits)
            idx = torch.topk(scores + self.expert_bias, k, dim=-1).indices
            weights = scores.gather(-1, idx)
            weights = weights / weights.sum(-1, keepdim=True)
            probs = torch.softmax(logits, -1) if self.moe.aux_loss_coef else None
        else:
            probs = torch.softmax(logits, -1)
            weights, idx = torch.topk(probs, k, dim=-1)
            if k > 1:  # Mixtral / Qwen3 (norm_topk_prob): the chosen weights sum to 1
                weights = weights / weights.sum(-1, keepdim=True)
        return idx, weights, probs


class SharedExperts(nn.Module):
    """The shared experts as one GELU MLP of their summed width (no bias)."""

    def __init__(self, d_model: int, hidden: int, make_linear, prefix: str):
        super().__init__()
        self.w1 = make_linear(f"{prefix}.shared.w1", d_model, hidden, False)
        self.w2 = make_linear(f"{prefix}.shared.w2", hidden, d_model, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(_act(self.w1(x)))


class LocalDispatch:
    """No expert parallelism: the sorted rows go to this rank's experts (all of them)."""

    ep = 1

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts):
        counts = counts.tolist()
        return experts(rows, counts), sum(counts)


class MoE(nn.Module):
    """The MoE feed-forward (see the module docstring); ``aux_loss`` holds the last forward's
    Switch loss (a tensor in the graph, 0 when off), which GPT.forward adds to its loss."""

    def __init__(self, moe: MoEArgs, d_model: int, dense_hidden: int, make_linear, prefix: str):
        super().__init__()
        self.moe = moe
        ffn = moe.ffn(dense_hidden)
        self.router = Router(moe, d_model, make_linear, f"{prefix}.router")
        self.experts = GroupedExperts(moe.experts, d_model, ffn, moe.gemm)
        self.shared = None
        if moe.shared_experts:
            self.shared = SharedExperts(d_model, moe.shared_experts * ffn, make_linear, prefix)
        self.dispatcher = LocalDispatch()  # dtrain.parallel.ep swaps in the all-to-all one
        self.aux_loss = None
        self.reset_stats()

    def reset_stats(self) -> None:
        """Per-step counters, summed over micro-batches (dtrain.train.moe reads them)."""
        self.stats = {"tokens_per_expert": None, "dropped": 0, "rank_rows": 0}

    def take_stats(self) -> dict:
        stats = self.stats
        self.reset_stats()
        return stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n, k, E = x.shape[0], self.moe.top_k, self.moe.experts
        idx, weights, probs = self.router(x)
        flat = idx.reshape(-1)
        counts = torch.bincount(flat, minlength=E)  # routed assignments per expert
        keep = None
        capacity = self.moe.capacity(n)
        if capacity is not None:  # first come, first served, in token order (Switch)
            onehot = F.one_hot(flat, E)
            position = (torch.cumsum(onehot, 0) * onehot).sum(-1) - 1
            keep = position < capacity
            flat = torch.where(keep, flat, E)  # dropped: sorted past the last expert
        order = torch.argsort(flat, stable=True)
        kept_counts = torch.bincount(flat, minlength=E + 1)[:E]
        kept = int(kept_counts.sum())
        order = order[:kept]
        token = order // k
        rows, rank_rows = self.dispatcher(x[token], kept_counts, self.experts)
        out = torch.zeros_like(x).index_add_(
            0, token, rows * weights.reshape(-1)[order, None].to(rows.dtype)
        )
        if self.shared is not None:
            out = out + self.shared(x)
        self.aux_loss = self._aux_loss(counts, probs, n)
        self._count(counts, n * k - kept, rank_rows)
        return out.reshape(shape)

    def _aux_loss(self, counts: torch.Tensor, probs: torch.Tensor | None, n: int):
        """Switch Transformer (Fedus et al. 2022, eq. 4): coef * E * sum_i f_i * P_i, f_i the
        share of assignments routed to i, P_i the mean router probability of i."""
        if not self.moe.aux_loss_coef or probs is None:
            return None
        f = counts.float() / (n * self.moe.top_k)
        return self.moe.aux_loss_coef * self.moe.experts * (f * probs.mean(0)).sum()

    @torch.no_grad()
    def _count(self, counts: torch.Tensor, dropped: int, rank_rows: int) -> None:
        s = self.stats
        c = counts.detach().to("cpu", torch.float64)
        s["tokens_per_expert"] = c if s["tokens_per_expert"] is None else s["tokens_per_expert"] + c
        s["dropped"] += int(dropped)
        s["rank_rows"] += int(rank_rows)  # rows this rank's experts computed


@torch.no_grad()
def init_moe(module: MoE, init_std: float, residual_std: float) -> None:
    """Weights in a fixed order: router, experts (w1 at init_std, w2 at the residual std, as the
    dense MLP's), shared experts; the selection bias zero."""
    nn.init.normal_(module.router.gate.weight, std=init_std)
    module.router.expert_bias.zero_()
    nn.init.normal_(module.experts.w1, std=init_std)
    nn.init.normal_(module.experts.w2, std=residual_std)
    if module.shared is not None:
        nn.init.normal_(module.shared.w1.weight, std=init_std)
        nn.init.normal_(module.shared.w2.weight, std=residual_std)
