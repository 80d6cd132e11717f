"""How a layout splits an MoE model (``moe_model.MoEModel``) in the cost model: its MoE layers on
the busiest pipeline stage, the tokens a rank dispatches and each local expert's rows, the
imbalance ρ the layout feels, and the ep degrees a layout can fold."""

from __future__ import annotations

from .moe_model import MoEModel
from .shapes import Layout, stage_layers


def stage_moe_layers(model: MoEModel, lay: Layout) -> int:
    """MoE layers on the busiest pipeline stage: ceil(L/pp) (a stage after the dense layers, which
    come first, holds that many), at most the MoE layers."""
    return min(stage_layers(model.base, lay.pp, lay.pp_split), model.moe_layers)


def rank_tokens(model: MoEModel, lay: Layout) -> float:
    """Tokens a rank dispatches per micro-batch: b·s/cp split over tp (torchtitan's EP splits the
    attention's tokens over the TP ranks before dispatch), all b·s/cp with expert TP (etp = tp,
    each rank then computes 1/etp of every expert)."""
    t = lay.micro_batch * model.base.seq_len / lay.cp
    return t if lay.etp > 1 else t / lay.tp


def rho(model: MoEModel, lay: Layout) -> float:
    """The imbalance a layout feels: ρ with EP; with ep = 1 every rank runs every expert on its
    own tokens, so uneven routing moves rows between its experts but adds none."""
    return model.moe.imbalance if lay.ep > 1 else 1.0


def tokens_per_expert(model: MoEModel, lay: Layout) -> float:
    """Rows of one local expert's grouped-GEMM slice on the busiest rank: T·k·ρ/(E/ep)."""
    m = model.moe
    return rank_tokens(model, lay) * m.top_k * rho(model, lay) * lay.ep / m.experts


def ep_degrees(model: MoEModel, lay: Layout) -> list[int]:
    """ep values a layout can fold: powers of two dividing the experts and dp_shard·cp·tp (etp 1),
    ep·etp within the fold with etp = tp."""
    fold = lay.expert_fold
    out, e = [], 1
    while e <= min(fold, model.moe.experts):
        if model.moe.experts % e == 0 and fold % e == 0:
            out.append(e)
        e *= 2
    return out
