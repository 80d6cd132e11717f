"""A plan as Hydra overrides for the shared trainer (`python -m fsdp_scaling <overrides>`).

    world_size = dp·cp·tp·pp                train.tp, train.pp, train.cp, train.cp_impl (ring |
                                            ulysses | torch)
    pp_virtual v > 1 -> train.pp_schedule=interleaved_1f1b train.pp_virtual=v; gpipe, zbv as named;
                      1f1b, or gpipe when there are fewer micro-batches than stages (1f1b needs >=
                      pp)
    train.strategy: Layout.strategy (dtrain.core.layout: ZeRO 0 -> ddp, 1 and 2 -> zero2, the
                      trainer has no optimizer-only sharding, 3 -> zero3; HSDP replicas R > 1 ->
                      hsdp, train.hsdp_replicate=R)
    recompute none / op / full -> activation_checkpointing=none / op / block; selective -> block
                      (the trainer has no attention-core-only recompute)
    micro_batch, global_batch (grad_accum is derived: global_batch / (micro_batch·dp))
    precision bf16 / fp8 -> train.precision=bf16 (FP8 recipes are fp8-train's)
    the model's layers, hidden, heads, kv heads, seq -> model.n_layer, d_model, n_head, n_kv_head,
    seq_len

    sequence_parallel -> train.sequence_parallel
    an MoE model (``moe_overrides``) -> train.ep, train.etp, model.moe.experts, top_k,
                      expert_ffn, shared_experts, dense_layers

What the trainer cannot express is listed in `notes` instead of being silently dropped: ZeRO-1,
selective recompute, FP8, a vocabulary other than the fsdp-scaling preset's, a gated MLP, cp
together with pp, the balanced pipeline split, and ZeRO-1/2 under pp, whose gradient reduction the
trainer runs after the last backward (not hidden as priced). `dtrain plan --software dtrain`
searches only layouts that need none of these notes.
"""

from __future__ import annotations

from dtrain.core.layout import checkpointing_of

from .shapes import Layout, ModelShape, run_schedule


def train_overrides(
    layout: Layout,
    model: ModelShape,
    global_batch: int,
    precision: str = "bf16",
    preset: str = "small",
) -> tuple[list[str], list[str]]:
    """(overrides, notes) for `layout` of `model`; the overrides run as is with fsdp-scaling."""
    world, replicas = layout.gpus, layout.hsdp_replicate
    schedule = run_schedule(layout)  # 1f1b needs a micro-batch per stage, else gpipe
    out = [
        f"world_size={world}",
        f"train.strategy={layout.strategy}",
        f"train.tp={layout.tp}",
        f"train.pp={layout.pp}",
        *([f"train.cp={layout.cp}", f"train.cp_impl={layout.cp_impl}"] if layout.cp > 1 else []),
        *([f"train.hsdp_replicate={replicas}"] if replicas > 1 else []),
        f"train.pp_schedule={schedule}",
        f"train.pp_virtual={layout.pp_virtual}",
        f"train.micro_batch={layout.micro_batch}",
        f"train.global_batch={global_batch}",
        f"train.activation_checkpointing={checkpointing_of(layout.recompute)}",
        f"train.precision={'fp32' if precision == 'fp32' else 'bf16'}",
        f"train.sequence_parallel={'true' if layout.sequence_parallel else 'false'}",
        f"model.preset={preset}",
        f"model.n_layer={model.n_layer}",
        f"model.d_model={model.d_model}",
        f"model.n_head={model.n_head}",
        f"model.n_kv_head={model.n_kv_head}",
        f"model.seq_len={model.seq_len}",
    ]
    notes = []
    if layout.pp_split != "layers" and layout.pp > 1:
        notes.append(
            f"split={layout.pp_split} runs as the trainer's own split (blocks spread evenly over "
            "the stages, the embedding on the first and the loss on the last)"
        )
    if layout.cp > 1 and layout.pp > 1:
        notes.append(
            "the trainer refuses cp with pp > 1: run cp·dp data-parallel ranks or pp without cp"
        )
    if layout.zero_stage == 1:
        notes.append("ZeRO-1 runs as zero2 (gradients sharded too)")
    if layout.zero_stage in (1, 2) and layout.pp > 1:
        notes.append(
            "under pp the trainer's zero2 reduces its gradients after the stage's last backward "
            "(torch.distributed.pipelining), which the plan's ZeRO-1/2 step hides behind it: the "
            "run exposes that reduce-scatter, as the plan prices zero=3 with pp"
        )
    if replicas > 1 and layout.zero_stage == 2:
        notes.append(
            "HSDP with ZeRO-2 runs as the trainer's hsdp, which reshards after forward (ZeRO-3 in "
            "each group)"
        )
    if layout.recompute == "selective":
        notes.append("selective recompute runs as whole-block checkpointing")
    if precision == "fp8":
        notes.append("fp8 runs as bf16 here; FP8 recipes are in fp8-train")
    if model.gated_mlp:
        notes.append("the trainer's GPT has a GELU MLP: the gated MLP runs as GELU 4x")
    from dtrain.model.args import PRESETS

    if PRESETS[preset].vocab_size != model.vocab:
        notes.append(
            f"vocabulary: the {preset} preset's {PRESETS[preset].vocab_size}, not {model.vocab}"
        )
    return out, notes


def moe_overrides(
    layout: Layout, model, global_batch: int, precision: str = "bf16", preset: str = "small"
) -> tuple[list[str], list[str]]:
    """``train_overrides`` of an MoE model (``moe_model.MoEModel``): its dense base's, plus the
    layout's ep and etp and the ``model.moe`` keys; what the trainer's MoE layer does not run
    (a shared expert of another width, DeepEP or allgather dispatch, A2A overlap, a head dim
    other than d / heads, MLA) goes to the notes."""
    out, notes = train_overrides(layout, model.base, global_batch, precision, preset)
    m = model.moe
    out += [
        f"train.ep={layout.ep}",
        f"train.etp={layout.etp}",
        f"model.moe.experts={m.experts}",
        f"model.moe.top_k={m.top_k}",
        f"model.moe.expert_ffn={m.expert_ffn}",
        f"model.moe.shared_experts={m.shared_experts}",
        f"model.moe.dense_layers={m.dense_layers}",
    ]
    if m.shared_experts and m.shared_ffn not in (0, m.expert_ffn):
        notes.append(
            f"the trainer's shared experts are expert_ffn ({m.expert_ffn}) wide, not {m.shared_ffn}"
        )
    if m.dispatcher != "alltoall":
        notes.append(f"the {m.dispatcher} dispatcher runs as the trainer's uneven all-to-all")
    if m.a2a_overlap:
        notes.append("the trainer does not overlap the all-to-all with other micro-batches")
    if model.mla is not None or model.hd != model.base.d_model // model.base.n_head:
        notes.append("the trainer's attention has d_model / n_head head dim (no MLA)")
    return out, notes


def trainer_refusal(overrides: list[str]) -> str | None:
    """Why the trainer refuses ``overrides`` (``train_overrides``' list, read as printed); None
    when it runs them. The trainer's own rules, called: ``dtrain.parallel.feasibility`` (cp with
    pp, tp and cp against the model, the pipeline) and ``ParallelDims.of`` (the degrees against
    world_size), on the GPTConfig the model.* keys build, as ``TrainConfig.validate`` and
    ``validate_model`` call them."""
    from dtrain.core.errors import UserError
    from dtrain.core.nodes import model_config
    from dtrain.parallel import feasibility as f
    from dtrain.parallel.mesh import ParallelDims

    values = dict(o.split("=", 1) for o in overrides)
    train = {k.removeprefix("train."): v for k, v in values.items() if k.startswith("train.")}
    model = {
        k.removeprefix("model."): v if k == "model.preset" else int(v)
        for k, v in values.items()
        if k.startswith("model.") and not k.startswith("model.moe.")
    }
    moe = {k.removeprefix("model.moe."): int(v) for k, v in values.items() if "model.moe." in k}
    if moe:
        model["moe"] = moe
    ep, etp = int(train.get("ep", 1)), int(train.get("etp", 1))
    tp, pp, cp = (int(train.get(k, 1)) for k in ("tp", "pp", "cp"))
    impl, sp = train.get("cp_impl", "ring"), train["sequence_parallel"] == "true"
    micro, batch = int(train["micro_batch"]), int(train["global_batch"])
    try:
        cfg = model_config(model)
        f.check_cp_layout(cp, impl, pp)
        dims = ParallelDims.of(
            int(values["world_size"]),
            tp=tp,
            pp=pp,
            strategy=train["strategy"],
            hsdp_replicate=int(train.get("hsdp_replicate", 1)),
            cp=cp,
            ep=ep,
        )
        f.check_moe(
            cfg, ep, etp, tp, pp, train["strategy"], train.get("activation_checkpointing", "none")
        )
        if batch % (micro * dims.dp):
            return (
                f"train.global_batch={batch} is not divisible by train.micro_batch x "
                f"data-parallel ranks = {micro} x {dims.dp}"
            )
        f.check_tp_model(cfg, tp, sp)
        f.check_cp_model(cfg, cp, impl, tp, sp)
        f.check_pipeline(
            cfg, pp, train["pp_schedule"], int(train["pp_virtual"]), batch // (micro * dims.dp)
        )
    except (UserError, ValueError) as e:
        return str(e)
    return None
