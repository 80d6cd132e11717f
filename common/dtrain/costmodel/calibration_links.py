"""allreduce-bench's collective fits as calibration candidates: α per ring hop and achieved β per
link class (``from_allreduce``), and the collectives with their own α–β entries
(``OWN_FIT_HOPS``)."""

from __future__ import annotations

import dataclasses

from dtrain.results import contract_records

from .calibration_records import Candidate, Source, finite_number

LINK_CLASSES = {"intra_node": "intra", "inter_node": "inter"}

# Collectives the time model costs with their own α–β when allreduce-bench fitted them
# (``LinkModel.of``), with the ring hops their whole-collective α spans over n ranks (all-to-all:
# one per peer, ``collectives.all_to_all_time``).
OWN_FIT_HOPS = {
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "sendrecv": lambda n: 1,
    "all_to_all": lambda n: n - 1,
    "all_to_all_v": lambda n: n - 1,  # uneven (expert parallelism's dispatch): allreduce-bench
}


def from_allreduce(fits: list[contract_records.CollectiveFit], src: Source) -> list[Candidate]:
    out = []
    for fit in map(dataclasses.asdict, fits):
        cls = LINK_CLASSES.get(fit.get("link_class"))
        alpha, beta = finite_number(fit.get("alpha_us")), finite_number(fit.get("beta_GBps"))
        name = fit.get("collective")
        if cls is None or alpha is None or not beta:
            continue
        if (
            name in OWN_FIT_HOPS
        ):  # "<cls>_<collective>_alpha_s" / "_beta_Bps": the local link's own entries
            n = int(fit.get("world_size") or 2)
            hops = max(1, OWN_FIT_HOPS[name](n))
            detail = f"{name} {fit.get('dtype', '?')} fit over {n} ranks; α per hop = α/{hops}"
            out.append(
                Candidate(f"{cls}_{name}_alpha_s", max(alpha, 0.0) * 1e-6 / hops, src, detail)
            )
            out.append(Candidate(f"{cls}_{name}_beta_Bps", beta * 1e9, src, detail))
            continue
        if name != "all_reduce":
            continue
        # The fit's α is the latency of a whole all_reduce over `world_size` ranks; the time model
        # charges α per ring hop, 2(n−1) of them, so convert to per-hop latency.
        n = int(fit.get("world_size") or 2)
        hops = 2 * (n - 1) if n > 1 else 1
        detail = (
            f"all_reduce {fit.get('dtype', '?')} fit over {n} ranks, {fit.get('n_points', '?')} "
            f"sizes, r²={fit.get('r2', float('nan')):.3f}; α per hop = α/{hops}"
        )
        out.append(Candidate(f"{cls}_alpha_s", max(alpha, 0.0) * 1e-6 / hops, src, detail))
        out.append(Candidate(f"{cls}_beta_Bps", beta * 1e9, src, detail))
        pct = finite_number(fit.get("beta_pct_of_theoretical"))
        if pct:
            out.append(
                Candidate(f"{cls}_efficiency", pct / 100, src, detail + f", {pct:.0f}% of nominal")
            )
    return out
