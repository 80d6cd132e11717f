"""What a layout cannot run, as one-line UserErrors, without torch: the command-line checks run
these before any process starts (and before torch is imported); the modules that apply each
parallelism import them from here.

    check_tp_heads / check_tp_model     the heads, MLP width and sequence tensor parallelism can
                                        split
    check_cp_layout / check_cp_device / check_cp_model   context parallelism's degree, device and
                                                         sequence
    check_pipeline                      the layers, schedules and micro-batches a pipeline needs
    check_moe                           what the trainer runs an MoE model and train.ep with
"""

from __future__ import annotations

from dtrain.core.checks import integer_at_least, one_of
from dtrain.core.errors import UserError
from dtrain.core.layout import CP_IMPLS

# dtrain.core.layout.CP_IMPLS is the one list of context-parallel implementations: ring and
# all-to-all (Ulysses) are dtrain.parallel.cp's own and run anywhere, gloo on CPU included; torch is
# PyTorch's
# context_parallel, which needs CUDA's fused SDPA.
OWN_CP_IMPLS = tuple(i for i in CP_IMPLS if i != "torch")  # this project's, runnable on CPU
IMPLS = ("auto", *CP_IMPLS)  # train.cp_impl: auto picks torch on CUDA + NCCL, else ring
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")  # train.pp_schedule
SINGLE_STAGE = ("gpipe", "1f1b")


def check_tp_heads(n_head: int, n_kv_head: int, tp: int) -> None:
    """The head layouts TP can split; a UserError that says what to change otherwise."""
    if n_head % tp:
        raise UserError(
            f"n_head={n_head} is not divisible by tp={tp}: pick a tp that divides the head count"
        )
    if n_head % n_kv_head:
        raise UserError(
            f"n_head={n_head} is not divisible by n_kv_head={n_kv_head}: pick n_kv_head dividing "
            "n_head"
        )
    if n_kv_head >= tp and n_kv_head % tp:
        raise UserError(
            f"n_kv_head={n_kv_head} is not divisible by tp={tp}: pick a tp that divides the k/v "
            "heads"
        )
    if n_kv_head < tp and tp % n_kv_head:
        raise UserError(
            f"tp={tp} is not a multiple of n_kv_head={n_kv_head}: k/v heads can only be "
            "replicated evenly; pick n_kv_head dividing tp"
        )


def check_tp_model(
    cfg,
    tp: int,
    sequence_parallel: bool = False,
    async_grad_allreduce: bool = False,
    impl: str = "handrolled",
) -> None:
    """The model shapes the trainer's TP (`impl`: handrolled | dtensor) can split; a one-line
    UserError otherwise."""
    if async_grad_allreduce and tp == 1:
        raise UserError(
            "train.async_grad_allreduce=true needs train.tp > 1 (it overlaps the tensor-parallel "
            "input-gradient collective)"
        )
    if sequence_parallel and tp == 1:
        raise UserError("train.sequence_parallel=true needs train.tp > 1")
    if sequence_parallel and cfg.seq_len % tp:
        raise UserError(
            f"train.sequence_parallel: model.seq_len={cfg.seq_len} is not divisible by "
            f"train.tp={tp}"
        )
    if tp == 1:
        return
    try:
        check_tp_heads(cfg.n_head, cfg.n_kv_head, tp)
    except UserError as e:
        raise UserError(f"train.tp={tp}: {e}") from None
    if cfg.mlp_hidden % tp:
        raise UserError(
            f"train.tp={tp} does not divide the MLP width {cfg.mlp_hidden}: pick another tp"
        )
    if impl == "dtensor" and cfg.n_kv_head % tp:
        raise UserError(
            f"train.tp_impl=dtensor cannot split model.n_kv_head={cfg.n_kv_head} k/v heads over "
            f"train.tp={tp} (DTensor does not replicate heads): use train.tp_impl=handrolled"
        )
    if impl == "dtensor" and async_grad_allreduce:
        raise UserError(
            "train.async_grad_allreduce=true is the hand-rolled layers' overlap: use "
            "train.tp_impl=handrolled"
        )


def check_cp_layout(cp, impl: str, pp: int) -> None:
    """train.cp and train.cp_impl on their own and with pipeline parallelism."""
    integer_at_least("train.cp", cp, 1)
    one_of("train.cp_impl", impl, IMPLS)
    if cp > 1 and pp > 1:  # the pipeline schedules pass stages only the tokens, not their positions
        raise UserError(
            f"train.cp={cp} with train.pp={pp} is not supported (a pipeline stage gets only the "
            "tokens, not their positions): use train.pp=1, or train.cp=1 with pipelining"
        )


def check_cp_device(cp: int, impl: str, device_type: str) -> None:
    if cp > 1 and impl == "torch" and device_type != "cuda":
        raise UserError(
            "train.cp_impl=torch needs CUDA (PyTorch's context_parallel runs on the fused SDPA "
            f"kernels) but the device is {device_type}: use "
            f"train.cp_impl={', '.join(OWN_CP_IMPLS)} or auto"
        )


def check_cp_model(model, cp: int, impl: str, tp: int = 1, sequence_parallel: bool = False) -> None:
    """The sequences and heads cp can split (`model` is a dtrain.model.args.GPTConfig)."""
    if cp == 1:
        return
    if model.seq_len % (2 * cp):
        raise UserError(
            f"train.cp={cp}: model.seq_len={model.seq_len} is not divisible by 2 x cp = {2 * cp} "
            f"(each rank holds 2 of 2·cp equal chunks): pick seq_len a multiple of {2 * cp}"
        )
    if sequence_parallel and (model.seq_len // cp) % tp:
        raise UserError(
            f"train.sequence_parallel: a cp rank's {model.seq_len // cp} tokens (model.seq_len / "
            f"train.cp) are not divisible by train.tp={tp}: pick seq_len a multiple of {cp * tp}"
        )
    if impl == "ulysses" and (model.n_head // tp) % cp:
        raise UserError(
            f"train.cp_impl=ulysses spreads a rank's {model.n_head // tp} query heads "
            f"(model.n_head / train.tp) over train.cp={cp} ranks, which does not divide them: use "
            "train.cp_impl=ring"
        )


def check_pipeline(cfg, pp: int, schedule: str, virtual: int, micro_batches: int) -> None:
    """Every layout the trainer cannot pipeline, as a one-line UserError."""
    one_of("train.pp_schedule", schedule, SCHEDULES)
    if pp == 1:
        return
    if schedule in SINGLE_STAGE and virtual != 1:
        raise UserError(
            f"train.pp_schedule={schedule} runs one stage per rank but train.pp_virtual={virtual}: "
            "set pp_virtual=1 or pick interleaved_1f1b / interleaved_zb / zbv"
        )
    if schedule in ("interleaved_1f1b", "interleaved_zb") and virtual < 2:
        raise UserError(f"train.pp_schedule={schedule} needs train.pp_virtual >= 2 stages per rank")
    if schedule == "zbv" and virtual != 2:
        raise UserError(
            "train.pp_schedule=zbv needs exactly train.pp_virtual=2 stages per rank (got "
            f"{virtual})"
        )
    stages = pp * virtual
    if cfg.n_layer < stages:
        raise UserError(
            f"model.n_layer={cfg.n_layer} < pipeline stages = train.pp x train.pp_virtual = "
            f"{pp} x {virtual} = {stages}: lower pp or pp_virtual, or add layers"
        )
    if micro_batches < pp and schedule != "gpipe":
        raise UserError(
            f"pipeline micro-batches (train.grad_accum={micro_batches}) < train.pp={pp}: raise "
            "train.global_batch (or grad_accum) so each step has at least pp micro-batches, "
            "or use train.pp_schedule=gpipe"
        )
    if schedule not in SINGLE_STAGE:
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            raise UserError(
                f"train.pp_schedule={schedule} needs micro-batches "
                f"(train.grad_accum={micro_batches}) divisible by their rounds ({rounds} = "
                f"grad_accum // pp): use a multiple of pp={pp}"
            )
    if cfg.tie_embeddings:
        raise UserError(
            "train.pp > 1 needs model.tie_embeddings=false: the embedding and lm_head live on "
            "different stages"
        )


def check_moe(
    model,
    ep: int,
    etp: int,
    tp: int,
    pp: int,
    strategy: str,
    checkpointing: str = "none",
    cp: int = 1,
) -> None:
    """What the trainer runs an MoE model (model.moe.experts > 0) and expert parallelism with:
    experts divisible by ep, expert TP 1, a sharded strategy for ep > 1 (the experts' FSDP2 over
    efsdp), tensor parallelism of the attention only where each tp rank can route its own share of
    the tokens (dtrain.parallel.ep.moe_tp: the sequence divisible by cp x tp; no Switch auxiliary
    loss, whose means would be over a tp rank's share), and not selective op activation
    checkpointing with ep > 1 (its policy would replay the dispatch's collectives). Pipeline
    parallelism runs any of these."""
    integer_at_least("train.ep", ep, 1)
    integer_at_least("train.etp", etp, 1)
    if etp != 1:
        raise UserError(f"train.etp={etp}: expert tensor parallelism is not implemented: use 1")
    moe = getattr(model, "moe", None)
    if ep > 1 and moe is None:
        raise UserError(f"train.ep={ep} needs an MoE model: set model.moe.experts (e.g. 4)")
    if moe is None:
        return
    if moe.experts % ep:
        raise UserError(
            f"model.moe.experts={moe.experts} is not divisible by train.ep={ep}: every ep rank "
            "holds the same number of experts"
        )
    if tp > 1 and (model.seq_len // cp) % tp:
        raise UserError(
            f"train.tp={tp} with an MoE model: each tp rank routes its share of a rank's "
            f"{model.seq_len // cp} tokens (model.seq_len / train.cp), which tp does not divide: "
            f"pick seq_len a multiple of {cp * tp}"
        )
    if tp > 1 and moe.aux_loss_coef:
        raise UserError(
            f"model.moe.aux_loss_coef={moe.aux_loss_coef} does not run with train.tp={tp} (each tp "
            "rank routes its share of the tokens): use 0 (the sigmoid router balances without "
            "it) or train.tp=1"
        )
    if ep > 1 and checkpointing == "op":
        raise UserError(
            f"train.activation_checkpointing=op does not run with train.ep={ep}: use block or none"
        )
    if ep > 1 and strategy not in ("zero2", "zero3"):
        raise UserError(
            f"train.ep={ep} runs with train.strategy=zero2 or zero3 (FSDP2 shards the experts "
            f"over efsdp), not {strategy}"
        )
