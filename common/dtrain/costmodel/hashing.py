"""A frozen dataclass's hash, computed once: the cost model keys its caches on shapes, clusters,
calibrations and kernel models, and a search hashes them hundreds of thousands of times (a
dataclass's own __hash__ rebuilds the tuple of every field, recursively, each time)."""

from __future__ import annotations

from dataclasses import fields


def cached_hash(self) -> int:
    h = self.__dict__.get("_cached_hash")
    if h is None:
        h = hash((type(self).__name__, *(getattr(self, f.name) for f in fields(self))))
        object.__setattr__(self, "_cached_hash", h)
    return h
