"""ParallelDims: the layout of the ranks, pp x dp x cp x tp, checked once and turned into one mesh.

    world_size = pp * dp * cp * tp,   dp = dp_replicate * dp_shard

Every layout has one: tp = pp = 1 included (then dp = world_size). The data-parallel strategy
decides how dp splits (`of`, by `dtrain.core.layout.split_dp`): ddp replicates (dp_replicate = dp),
zero2 / zero3 shard (dp_shard = dp), hsdp does both (dp_replicate = train.hsdp_replicate), single
has dp = 1.

Mesh dimensions, outermost first (as torchtitan's ParallelDims): ``pp``, ``replicate``,
``shard``, ``cp``, ``tp``; tp is innermost, so a tp group is consecutive ranks (one node's fast
links), then cp (context parallelism: the ranks that share each sequence, dtrain.parallel.cp), and
pp is outermost (its point-to-point traffic is the lightest). Only dimensions of size > 1 are built
(each is a process group, and gloo groups are slow to create). A new dimension is one more entry in
`ORDER` (and in `MODEL_DIMS` when it splits the model rather than the batch) and a field.

Ranks that share a (replicate, shard) coordinate form one data-parallel replica: they read the
same batch (`dp_rank`, `dp`), split the model by tp and pp and each sequence by cp. Gradients are
averaged over replicate x shard x cp: the cp ranks of a replica computed the gradients of
different tokens, like data-parallel ranks (FSDP2 shards over shard x cp, as torchtitan does).

Expert parallelism (``ep``) is no dimension of this mesh: it folds from the ranks that shard one
replica's data (torchtitan's rule dp_shard·cp·tp = efsdp·ep with etp = 1; `Layout.expert_fold`),
so the experts get their own mesh, ``build_expert_mesh``: (pp, replicate, efsdp, ep), ep
innermost, so an ep group is consecutive ranks.

Torch-free at import: the cost model uses `ParallelDims.of` for the dp and shard degrees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.core.errors import UserError
from dtrain.core.layout import Layout, split_dp, zero_stage_of

ORDER = ("pp", "replicate", "shard", "cp", "tp")  # mesh dimensions, outermost first
MODEL_DIMS = (
    "pp",
    "tp",
)  # dimensions that split the model; the rest split the batch (cp: its sequences)


@dataclass
class ParallelDims:
    world_size: int
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1  # data-parallel replicas (ddp: dp; hsdp: its replica groups)
    dp_shard: int = -1  # ranks one replica is sharded over (FSDP2); -1 = the rest of dp
    cp: int = 1  # context parallelism: ranks that share each sequence
    ep: int = 1  # expert parallelism, folded from shard x cp x tp (expert_mesh)
    _mesh: object = field(default=None, repr=False, compare=False)
    _expert_mesh: object = field(default=None, repr=False, compare=False)
    _flat: dict = field(
        default_factory=dict, repr=False, compare=False
    )  # flattened meshes, by name

    def __post_init__(self):
        for name in ("world_size", "tp", "pp", "cp", "dp_replicate"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must be >= 1")
        cp_key, cp_name, cp_value = (
            (" x train.cp", " x cp", f" x {self.cp}") if self.cp > 1 else ("", "", "")
        )
        if self.world_size % (self.tp * self.pp * self.cp):
            raise UserError(
                f"world_size={self.world_size} is not divisible by train.tp x train.pp{cp_key} = "
                f"{self.tp} x {self.pp}{cp_value}: pick degrees whose product divides world_size"
            )
        if self.dp % self.dp_replicate:  # the one HSDP check
            raise UserError(
                f"train.strategy=hsdp: dp = world_size / (tp x pp{cp_name}) = {self.dp} ranks do "
                f"not factor into train.hsdp_replicate={self.dp_replicate} replicas x shards: "
                "pick world_size as a multiple of it or another hsdp_replicate"
            )
        if self.dp_shard == -1:
            self.dp_shard = self.dp // self.dp_replicate
        if self.dp_replicate * self.dp_shard != self.dp:
            raise UserError(
                f"dp_replicate x dp_shard = {self.dp_replicate} x {self.dp_shard} != dp = {self.dp}"
            )
        fold = self.dp_shard * self.cp * self.tp
        if self.ep < 1 or fold % self.ep:
            raise UserError(
                f"train.ep={self.ep} does not divide dp_shard x cp x tp = {self.dp_shard} x "
                f"{self.cp} x {self.tp}: the experts fold from the attention's sharded data, "
                "context and tensor ranks"
            )

    @classmethod
    def of(
        cls,
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        strategy: str = "zero3",
        hsdp_replicate: int = 1,
        cp: int = 1,
        ep: int = 1,
    ) -> "ParallelDims":
        """The layout a data-parallel strategy gives: the one place dp is split into replicas and
        shards."""
        dp = cls(world_size, tp=tp, pp=pp, cp=cp).dp
        if strategy == "hsdp":  # the one HSDP check (__post_init__) before the split
            cls(world_size, tp=tp, pp=pp, cp=cp, dp_replicate=hsdp_replicate)
        replicate, shard = split_dp(
            strategy, dp, hsdp_replicate
        )  # dtrain.core.layout: the one rule
        return cls(world_size, tp=tp, pp=pp, cp=cp, dp_replicate=replicate, dp_shard=shard, ep=ep)

    @classmethod
    def from_layout(cls, layout: Layout) -> "ParallelDims":
        """The mesh of a layout (dtrain.core.layout.Layout: the degrees; this class adds the
        mesh)."""
        return cls(
            layout.gpus,
            tp=layout.tp,
            pp=layout.pp,
            cp=layout.cp,
            dp_replicate=layout.dp_replicate,
            dp_shard=layout.dp_shard,
            ep=layout.ep,
        )

    @property
    def dp(self) -> int:
        """Data-parallel replicas: groups of ranks that read different batches."""
        return self.world_size // (self.tp * self.pp * self.cp)

    def degree(self, name: str) -> int:
        return {
            "pp": self.pp,
            "replicate": self.dp_replicate,
            "shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }[name]

    @property
    def model_parallel(self) -> bool:
        """True when a rank holds only part of the model (tp or pp > 1)."""
        return any(self.degree(d) > 1 for d in MODEL_DIMS)

    @property
    def efsdp(self) -> int:
        """Ranks FSDP shards each expert over: shard x cp x tp / ep."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def describe(self) -> str:
        extra = "".join(f"x{k}{getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) > 1)
        return f"dp{self.dp}xtp{self.tp}xpp{self.pp}" + extra

    def build_expert_mesh(self, device_type: str):
        """The experts' mesh (collective: every rank calls it): (pp, replicate, efsdp, ep), each
        dimension built even at size 1, so FSDP2 always has an efsdp mesh to shard experts over."""
        if self._expert_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            names = ("pp", "replicate", "efsdp", "ep")
            sizes = (self.pp, self.dp_replicate, self.efsdp, self.ep)
            self._expert_mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        return self._expert_mesh

    def dims(self) -> list[tuple[str, int]]:
        """(name, size) of the mesh dimensions that are built, outermost first."""
        return [(name, self.degree(name)) for name in ORDER if self.degree(name) > 1]

    def build_mesh(self, device_type: str, *, one_rank: bool = False):
        """The world's DeviceMesh (collective: every rank calls it once). None on one rank, unless
        `one_rank`: then a 1-rank ``shard`` mesh (FSDP2 on a single rank measures its own cost)."""
        if self._mesh is None and (self.world_size > 1 or one_rank):
            from torch.distributed.device_mesh import init_device_mesh

            names, sizes = zip(*self.dims()) if self.dims() else (("shard",), (1,))
            self._mesh = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
        return self._mesh

    @property
    def mesh(self):
        if self._mesh is None and self.world_size > 1:
            raise RuntimeError("ParallelDims.build_mesh(device_type) has not been called")
        return self._mesh

    def submesh(self, name: str):
        """The 1-D mesh of one dimension (None when that dimension is not built)."""
        if self._mesh is None or name not in self._mesh.mesh_dim_names:
            return None
        return self._mesh[name]

    def flat_mesh(self, names: tuple[str, ...]):
        """The 1-D mesh over the built dimensions among `names` (flattened when several: e.g.
        shard x cp); None when none is built."""
        built = tuple(n for n in names if self._mesh is not None and n in self._mesh.mesh_dim_names)
        if len(built) <= 1:
            return self._mesh[built[0]] if built else None
        name = "_".join(built)
        if name not in self._flat:
            self._flat[name] = self._mesh[built]._flatten(name)
        return self._flat[name]

    def dp_mesh(self):
        """The mesh FSDP2 shards over: (replicate, shard x cp), the dims that are built; None if
        there is none."""
        shard = self.flat_mesh(("shard", "cp"))
        if shard is None or self.submesh("replicate") is None:
            return shard or self.submesh("replicate")
        return self._mesh[("replicate", "_".join(n for n in ("shard", "cp") if self.degree(n) > 1))]

    def replica_group(self):
        """The process group over which whole-model replicas average their gradients (DDP, or the
        loop's all-reduce): replicate x cp; None when it is one rank."""
        mesh = self.flat_mesh(("replicate", "cp"))
        return None if mesh is None else mesh.get_group()

    def coordinate(self, name: str) -> int:
        """This rank's index along a dimension (0 when it is not built)."""
        sub = self.submesh(name)
        return 0 if sub is None else sub.get_local_rank()

    @property
    def dp_rank(self) -> int:
        """Which data-parallel replica this rank belongs to, in [0, dp)."""
        return self.coordinate("replicate") * self.dp_shard + self.coordinate("shard")


def zero_stage(strategy: str, dp: int, pp: int = 1) -> int:
    """The ZeRO stage the trainer runs: the strategy's, 0 without data parallelism, and 2 for a
    sharded strategy under pp > 1 (parameters stay gathered from forward to backward there)."""
    return zero_stage_of(strategy, dp, pp)
