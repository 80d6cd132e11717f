"""The shared Hydra configs: `dtrain_base.yaml` (run directories) and the selftest's typed
config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dtrain.core.nodes import BaseConfig, register


@dataclass
class SelftestConfig(BaseConfig):
    subproject: str = "selftest"
    numel: int = 1024
    fail_rank: Optional[int] = None  # make this rank raise, to see how a failure propagates
    work_s: float = (
        0  # keep all-reducing this long first (time to interrupt, stop or kill something)
    )


register("selftest_schema", SelftestConfig)
