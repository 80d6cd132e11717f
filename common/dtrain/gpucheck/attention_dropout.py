"""The attention sweep's dropout slowdown per backend (``dropout_slowdown``): kernels.yaml's
attention ``dropout``, and the gpu-check report's attention_sweep cell."""

from __future__ import annotations

import statistics

TRAINING_SEQS = (
    1024,
    16384,
)  # the sequence lengths dropout-trained models run at, for the dropout median


def dropout_slowdown(points: list[dict]) -> dict[str, tuple[tuple[int, ...], float]]:
    """Per backend: (sequences, median of fwd+bwd time with dropout_p > 0 / without) over the
    causal sequences of TRAINING_SEQS measured both ways with the same heads: kernels.yaml's
    attention ``dropout``."""

    def key(
        p: dict,
    ) -> tuple:  # the KV heads too: a GQA point of the same head dim is another kernel
        return p["backend"], p["head_dim"], p.get("kv_heads"), p["seq"]

    base = {
        key(p): p["fwd_bwd_s"]
        for p in points
        if p["causal"] and not p.get("dropout_p") and "fwd_bwd_s" in p
    }
    ratios: dict[str, dict[int, float]] = {}
    for p in points:
        if (
            p.get("dropout_p")
            and "fwd_bwd_s" in p
            and key(p) in base
            and TRAINING_SEQS[0] <= p["seq"] <= TRAINING_SEQS[1]
        ):
            ratios.setdefault(p["backend"], {})[p["seq"]] = p["fwd_bwd_s"] / base[key(p)]
    return {b: (tuple(sorted(r)), statistics.median(r.values())) for b, r in ratios.items()}
