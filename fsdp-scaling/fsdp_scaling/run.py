"""One training run under one strategy and layout, measured (the per-rank side of `python -m
fsdp_scaling`).

Records per step (loss, grad norm, tokens/s, TFLOP/s, MFU, peak memory), per-rank state bytes
against the ZeRO formula (with tp / pp: this rank's stages and tp shards, sharded over dp), and
the comm/compute overlap and step breakdown (compute, TP comm, PP p2p and bubble, DP comm) of a
profiled window; the summary's "guide_inputs" (dtrain.results.contract) hold what the parallelism
guide reads.
"""

from __future__ import annotations


from dtrain.core import nodes as dtrain_config
from dtrain.model.args import model_dict
from dtrain.parallel.ep.trainer_ep import is_expert_param
from dtrain.run.rank import RankContext
from dtrain.train import Trainer, TrainConfig
from fsdp_scaling import memory
from fsdp_scaling.probes import ProfileWindow, StateBytes


def model_config(node):
    """The `model:` node (preset + GPTConfig fields) as a GPTConfig."""
    return dtrain_config.model_config(node)


def rank_fn(ctx: RankContext) -> dict:
    train = TrainConfig.from_cfg(ctx.cfg.train)
    model_cfg = model_config(ctx.cfg.model)
    state = StateBytes()
    callbacks = [state]
    window = None
    if ctx.cfg.profile.enabled:
        window = ProfileWindow(
            train.timing_warmup + 1, ctx.cfg.profile.steps, ctx.run_dir / "profile"
        )
        callbacks.append(window)
    trainer = Trainer(ctx, train, model_cfg, callbacks=callbacks)
    result = trainer.run()
    shapes = [
        memory.tp_local_shape(p) for p in trainer.model.parameters()
    ]  # this rank's stages, tp shards
    dims, shards = (
        trainer.dims,
        trainer.parallel.shard_degree,
    )  # FSDP2 shards the tp x pp piece over shard x cp
    formula = memory.formula_bytes(shapes, shards, trainer.parallel.shard_index)
    if dims.ep > 1:  # experts: this ep rank's slice, FSDP2-sharded over efsdp (not over shards)
        expert = [is_expert_param(n) for n, _ in trainer.model.named_parameters()]
        dense = memory.formula_bytes(
            [s for s, e in zip(shapes, expert) if not e], shards, trainer.parallel.shard_index
        )
        experts = memory.formula_bytes(
            [(s[0] // dims.ep, *s[1:]) for s, e in zip(shapes, expert) if e],  # this ep rank's
            dims.efsdp,
            trainer.parallel.shard_index // dims.ep,
        )
        formula = {k: dense[k] + experts[k] for k in dense}
    ideal = memory.ideal_bytes(trainer.model_params, len(shapes), shards * dims.tp * dims.pp)
    ctx.writer.record(
        "state_bytes",
        rank=ctx.rank,
        shards=shards,
        **{f"measured_{k}": v for k, v in state.measured.items()},
        **{f"formula_{k}": v for k, v in formula.items()},
        **{f"ideal_{k}": v for k, v in ideal.items()},
    )
    return {
        **result,
        "state_bytes": state.measured,
        "state_bytes_formula": formula,
        "state_bytes_ideal": ideal,
        "shard_degree": shards,
        "overlap": window.result if window else None,
        "breakdown": window.breakdown if window else None,
        "trace": str(window.trace_path) if window and window.trace_path else None,
        "device": str(ctx.device),
        "backend": ctx.backend,
        "gpu_name": ctx.gpu_name,
        "model": model_dict(model_cfg),
        "train": trainer.train.to_dict(),
    }  # as the run used it (grad_accum, precision derived)
