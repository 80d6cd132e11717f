"""Layout: how one training step is spread over ranks, the one type the trainer, the mesh, the cost
model, the contract's records, the guide and the plan -> trainer overrides share (issue 38).

    world_size = pp * dp * cp * tp,   dp = dp_replicate * dp_shard
    expert folding (torchtitan, Megatron's "parallel folding"):  fold = efsdp * ep * etp

Names are torchtitan's: ``dp_replicate`` ranks hold whole replicas (DDP, or HSDP's replica
groups), ``dp_shard`` ranks split one replica's states (FSDP / ZeRO). ``zero_stage`` says what is
sharded; with zero_stage 0 nothing is, so the layout is stored as DDP (dp_shard folded into
dp_replicate): one layout, one value. The schedule (``pp_schedule`` in the cost model's words,
interleaving as ``pp_virtual`` > 1), ``recompute``, the micro-batch and ``grad_accum`` complete it.

The trainer's ``train.strategy`` names map to (dp_replicate, dp_shard, zero_stage) here and only
here (``from_strategy``, ``strategy``). Torch-free and at the base layer: every layer imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Recompute levels, least to most: none; "op" = torchtitan's selective op AC (its checkpoint policy
# saves the outputs of every other matmul and of SDPA, recomputes the rest); "selective" =
# Korthikanti et al. 2022 §5 (the attention core only); "full" = whole blocks (the trainer's
# activation_checkpointing=block).
RECOMPUTE = ("none", "op", "selective", "full")
# Pipeline schedules: 1F1B (Narayanan et al. 2021; interleaved with v > 1 virtual stages), GPipe
# (Huang et al. 2019: every micro-batch's forward before any backward) and zero-bubble V (Qi et al.
# 2024, ICLR: two chunks per rank in a V, weight-gradient work fills the bubble).
PP_SCHEDULES = ("1f1b", "gpipe", "zbv")
# Context parallelism: ring attention (Liu et al. 2023; PyTorch's context_parallel and Llama 3's
# all-gather CP move the same K/V bytes) or all-to-all sequence<->heads (Jacobs et al. 2023,
# DeepSpeed Ulysses).
CP_IMPLS = ("ring", "ulysses", "torch")
# How layers are split over pipeline stages: "layers" gives every stage ceil(L/pp) transformer
# layers, the embedding riding on the first and the output projection and loss on the last
# (Megatron's and DeepSpeed's default); "balanced" counts the embedding and the loss as one layer's
# slot each, so the first and the last stage hold one layer fewer (Megatron's
# --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split; Llama 3 405B,
# Llama Team 2024 §3.3.2).
PP_SPLITS = ("layers", "balanced")

# The shared trainer's data-parallel strategies (train.strategy) and the ZeRO stage each runs:
#   single  one rank          ddp    replicated, all-reduce   zero2  FSDP2, params kept after fwd
#   zero3   FSDP2, resharded   hsdp   FSDP2 sharded in a node, replicated across (ZeRO-3 memory)
ZERO_STAGE = {"single": 0, "ddp": 0, "zero2": 2, "zero3": 3, "hsdp": 3}
STRATEGIES = tuple(ZERO_STAGE)
SHARDED = ("zero2", "zero3", "hsdp")  # built with FSDP2's fully_shard
# the strategy that runs a ZeRO stage (the trainer has no optimizer-only sharding)
_STRATEGY_OF_ZERO = {0: "ddp", 1: "zero2", 2: "zero2", 3: "zero3"}
# train.activation_checkpointing <-> recompute: block checkpointing is "full"; Korthikanti's
# "selective" (the attention core) runs as whole blocks
_RECOMPUTE_OF_CHECKPOINTING = {"none": "none", "op": "op", "block": "full"}
_CHECKPOINTING_OF_RECOMPUTE = {"none": "none", "op": "op", "selective": "block", "full": "block"}
# train.pp_schedule <-> (pp_schedule, interleaved); interleaved_zb is priced as interleaved 1F1B
_SCHEDULE_OF_TRAINER = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved_1f1b": "1f1b",
    "interleaved_zb": "1f1b",
    "zbv": "zbv",
}


def split_dp(strategy: str, dp: int, hsdp_replicate: int = 1) -> tuple[int, int]:
    """(dp_replicate, dp_shard) a strategy gives dp ranks: ddp replicates, zero2 / zero3 shard,
    hsdp does both (hsdp_replicate groups), single has dp = 1."""
    if strategy == "ddp":
        return dp, 1
    if strategy == "hsdp":
        return hsdp_replicate, dp // hsdp_replicate
    return 1, dp


def zero_stage_of(strategy: str, data_shards: int, pp: int = 1) -> int:
    """The ZeRO stage the trainer runs: the strategy's, 0 without data parallelism (dp x cp = 1),
    and 2 for a sharded strategy under pp > 1 (parameters stay gathered from forward to
    backward)."""
    if data_shards == 1:
        return 0
    return 2 if pp > 1 and strategy in SHARDED else ZERO_STAGE[strategy]


def recompute_of(checkpointing: str, default: str | None = None) -> str:
    """train.activation_checkpointing -> the layout's recompute level (``default`` for an
    unknown one, e.g. a record's; without it an unknown one is a KeyError)."""
    if default is not None:
        return _RECOMPUTE_OF_CHECKPOINTING.get(checkpointing, default)
    return _RECOMPUTE_OF_CHECKPOINTING[checkpointing]


def checkpointing_of(recompute: str) -> str:
    """The layout's recompute level -> train.activation_checkpointing (selective runs as block)."""
    return _CHECKPOINTING_OF_RECOMPUTE[recompute]


def schedule_of(trainer_schedule: str) -> str:
    """train.pp_schedule -> the layout's pp_schedule (interleaving is pp_virtual)."""
    return _SCHEDULE_OF_TRAINER[trainer_schedule]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One step's parallel layout, keyword-only. Rank order is torchtitan's and Megatron's: TP
    innermost (consecutive ranks), then CP, then DP (shard inside replicate), then PP.

    ``pp_virtual`` > 1 is the interleaved 1F1B schedule (Narayanan et al. 2021). ``cp`` > 1
    splits every sequence over cp ranks: ``cp_impl`` ring passes K and V around the cp group,
    ulysses swaps sequence for heads with all-to-alls (DeepSpeed Ulysses), torch is PyTorch's
    ``context_parallel``. dp_replicate > 1 with zero_stage >= 2 is HSDP: ZeRO shards over
    ``shard_group`` = dp_shard·cp ranks and the dp_replicate groups all-reduce the sharded
    gradients.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism, folded from the ranks attention uses (``expert_fold``)
    etp: int = 1  # expert tensor parallelism: 1 or tp
    zero_stage: int = 0
    recompute: str = "none"
    micro_batch: int = 1
    grad_accum: int = 1
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"  # 1f1b (interleaved when pp_virtual > 1) | gpipe | zbv
    pp_virtual: int = 1
    cp_impl: str = "ring"  # ring | ulysses | torch
    pp_split: str = "layers"  # layers | balanced (see PP_SPLITS)

    def __post_init__(self) -> None:
        # a search builds ~10^5 layouts: the common cases cost a few comparisons
        if self.zero_stage == 0 and self.dp_shard != 1:  # nothing sharded: stored as DDP
            object.__setattr__(self, "dp_replicate", self.dp_replicate * self.dp_shard)
            object.__setattr__(self, "dp_shard", 1)
        if self.ep != 1 or self.etp != 1:
            self._check_experts()
        if min(self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.pp_virtual) < 1:
            raise ValueError(f"every degree must be >= 1, got {self.describe()}")
        if self.dp_replicate != 1 and self.zero_stage == 1:
            raise ValueError(
                "dp_replicate > 1 is HSDP: FSDP sharding inside each replica group "
                "(zero_stage 2 or 3)"
            )
        if self.cp_impl not in CP_IMPLS:
            raise ValueError(
                f"cp must be >= 1 and cp_impl one of {CP_IMPLS}, got {self.cp}, {self.cp_impl!r}"
            )
        if self.pp_split not in PP_SPLITS:
            raise ValueError(f"pp_split must be one of {PP_SPLITS}, got {self.pp_split!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"pp_schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}")
        if self.pp_schedule == "zbv" and self.pp_virtual != 2:
            raise ValueError("the zbv schedule runs 2 virtual stages per rank (virtual_stages=2)")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0..3, got {self.zero_stage}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")

    def _check_experts(self) -> None:
        if min(self.ep, self.etp) < 1 or self.etp not in (1, self.tp):
            raise ValueError(
                f"ep must be >= 1 and etp 1 or tp={self.tp}, got {self.ep}, {self.etp}"
            )
        if self.expert_fold % (self.ep * self.etp):
            raise ValueError(
                f"ep·etp = {self.ep * self.etp} must divide the ranks experts fold from, "
                f"dp_shard·cp·tp = {self.expert_fold} (torchtitan's dp_shard·cp·tp = efsdp·ep)"
            )

    @classmethod
    def from_strategy(cls, strategy: str, *, dp: int, hsdp_replicate: int = 1, **rest) -> Layout:
        """The layout train.strategy gives dp data-parallel ranks (the one place the rule lives)."""
        rep, shard = split_dp(strategy, dp, hsdp_replicate)
        zero = zero_stage_of(strategy, dp * rest.get("cp", 1), rest.get("pp", 1))
        return cls(dp_replicate=rep, dp_shard=shard, zero_stage=zero, **rest)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: groups of ranks that read different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def virtual_stages(self) -> int:
        """The cost model's name for pp_virtual."""
        return self.pp_virtual

    @property
    def gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    world_size = gpus

    @property
    def data_shards(self) -> int:
        """Ranks that hold different data of the same model shard: the DP group of the gradients
        and of ZeRO's sharding, dp·cp (FSDP shards over dp x cp, as torchtitan does; Megatron
        reduces over both)."""
        return self.dp * self.cp

    @property
    def shard_group(self) -> int:
        """Ranks ZeRO shards the states over: dp_shard·cp (under HSDP one replica group's);
        without ZeRO every data shard (the group whose all-reduce the gradients run)."""
        return self.dp_shard * self.cp if self.zero_stage else self.data_shards

    @property
    def expert_fold(self) -> int:
        """Ranks one expert layer is spread over, folded from the attention's data and context
        shards and its tp: dp_shard·cp·tp (torchtitan's ``ParallelDims``; with ZeRO 0, whose
        dp_shard is stored as dp_replicate, dp·cp·tp as Megatron folds EP from DP)."""
        shards = self.dp_shard if self.zero_stage else self.dp
        return shards * self.cp * self.tp

    @property
    def efsdp(self) -> int:
        """The expert-data-parallel shards inside a fold: fold / (ep·etp). Expert gradients and
        states reduce and shard over ``expert_dp`` = efsdp x the HSDP replicas."""
        return self.expert_fold // (self.ep * self.etp)

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same expert shard: gpus / (pp·ep·etp)."""
        return self.gpus // (self.pp * self.ep * self.etp)

    @property
    def hsdp_replicate(self) -> int:
        """HSDP's replica groups (train.hsdp_replicate): dp_replicate when the states are
        sharded, else 1."""
        return self.dp_replicate if self.zero_stage else 1

    @property
    def strategy(self) -> str:
        """The train.strategy that runs this layout (ZeRO-1 runs as zero2: no optimizer-only
        sharding)."""
        if self.gpus == 1:
            return "single"
        return "hsdp" if self.hsdp_replicate > 1 else _STRATEGY_OF_ZERO[self.zero_stage]

    @property
    def trainer_schedule(self) -> str:
        """The train.pp_schedule that runs this layout's schedule."""
        if self.pp_schedule == "1f1b" and self.pp_virtual > 1:
            return "interleaved_1f1b"
        return self.pp_schedule

    def describe(self) -> str:
        """Its degrees, e.g. dp8xtp2xpp4 (cp when > 1)."""
        ep = f"xep{self.ep}" if self.ep > 1 else ""
        return (
            f"dp{self.dp}xtp{self.tp}xpp{self.pp}" + (f"xcp{self.cp}" if self.cp > 1 else "") + ep
        )
