"""The shared trainer's data-parallel strategies, kept importable here: the list and its rules live
in `dtrain.layout` (the one layout type, issue 38)."""
from __future__ import annotations

from dtrain.layout import SHARDED, STRATEGIES, ZERO_STAGE  # noqa: F401
