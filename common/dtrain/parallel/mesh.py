"""ParallelDims: the layout of the ranks, pp x dp x tp, checked once and turned into one mesh.

    world_size = pp * dp * tp,   dp = dp_replicate * dp_shard

Mesh dimensions, outermost first (as torchtitan's ParallelDims): ``pp``, ``replicate``,
``shard``, ``tp``; tp is innermost, so a tp group is consecutive ranks (one node's fast links),
and pp is outermost (its point-to-point traffic is the lightest). Only dimensions of size > 1
are built (each is a process group, and gloo groups are slow to create); the data-parallel
dimensions are always built when dp > 1 because FSDP2 needs a mesh for them.

Ranks that share a (replicate, shard) coordinate form one data-parallel replica: they read the
same batch (`dp_rank`, `dp`), split the model by tp and pp, and their gradients are averaged
with the other replicas'.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.errors import UserError


@dataclass
class ParallelDims:
    world_size: int
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1  # hsdp replica groups (1 = plain sharding or ddp)
    _mesh: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        for name in ("world_size", "tp", "pp", "dp_replicate"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must be >= 1")
        if self.world_size % (self.tp * self.pp):
            raise UserError(f"world_size={self.world_size} is not divisible by train.tp x train.pp = "
                            f"{self.tp} x {self.pp}: pick tp and pp whose product divides world_size")
        if self.dp % self.dp_replicate:
            raise UserError(f"dp = world_size / (tp x pp) = {self.dp} is not divisible by "
                            f"train.hsdp_replicate={self.dp_replicate}: pick another hsdp_replicate")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def model_parallel(self) -> bool:
        """True when a rank holds only part of the model (tp or pp > 1)."""
        return self.tp > 1 or self.pp > 1

    @property
    def describe(self) -> str:
        return f"dp{self.dp}xtp{self.tp}xpp{self.pp}"

    def dims(self) -> list[tuple[str, int]]:
        """(name, size) of the mesh dimensions that are built, outermost first."""
        out = [("pp", self.pp)] if self.pp > 1 else []
        if self.dp_replicate > 1:
            out.append(("replicate", self.dp_replicate))
        if self.dp_shard > 1 or (self.dp > 1 and self.dp_replicate == 1):
            out.append(("shard", self.dp_shard))
        if self.tp > 1:
            out.append(("tp", self.tp))
        return out

    def build_mesh(self, device_type: str):
        """The world's DeviceMesh (collective: every rank calls it once). None on one rank."""
        if self._mesh is None and self.world_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            names, sizes = zip(*self.dims()) if self.dims() else ((), ())
            self._mesh = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
        return self._mesh

    @property
    def mesh(self):
        if self._mesh is None and self.world_size > 1:
            raise RuntimeError("ParallelDims.build_mesh(device_type) has not been called")
        return self._mesh

    def submesh(self, name: str):
        """The 1-D mesh of one dimension (None when that dimension has size 1)."""
        return self.mesh[name] if name in dict(self.dims()) else None

    def dp_mesh(self):
        """The mesh FSDP2 shards over: (replicate, shard) for hsdp, (shard,) otherwise; None if dp = 1."""
        names = [n for n, _ in self.dims() if n in ("replicate", "shard")]
        if not names:
            return None
        return self.mesh[tuple(names)] if len(names) > 1 else self.mesh[names[0]]

    def coordinate(self, name: str) -> int:
        """This rank's index along a dimension (0 when it is not built)."""
        sub = self.submesh(name)
        return 0 if sub is None else sub.get_local_rank()

    @property
    def dp_rank(self) -> int:
        """Which data-parallel replica this rank belongs to, in [0, dp)."""
        return self.coordinate("replicate") * self.dp_shard + self.coordinate("shard")
