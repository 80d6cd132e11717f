"""tp-attention's records as calibration candidates: the TP layers' measured over α–β-modelled
communication time (``from_tp``, over the flat rows of ``tp_rows``), and the CP ring layers'
hidden share of the K/V sends (``from_cp``)."""

from __future__ import annotations

from dtrain.results import contract_records

from .calibration_records import Candidate, RunInputs, Source, finite_number
from .hardware import LinkModel


def tp_regions(module: str) -> int:
    """TP regions per layer: a block has two (attention, MLP), attention alone one."""
    return 1 if module == "attention" else 2


def tp_modelled_comm_s(row: dict, link: LinkModel, regions: int = 2) -> float:
    """α–β time of one layer's TP collectives, forward + backward. ``comm_bytes_per_layer`` is
    already in bus bytes (tp-attention's convention, = nccl-tests busbw bytes), so it goes over β
    unchanged; each region issues 2 all-reduces (or all-gather + reduce-scatter pairs with SP)
    per direction, 2(n−1) latency hops each (Megatron §3; Korthikanti §4.2.2)."""
    tp = int(row["tp"])
    return (
        float(row["comm_bytes_per_layer"]) / link.beta_Bps + 4 * regions * (tp - 1) * link.alpha_s
    )


def tp_rows(inputs: RunInputs) -> list[tuple[dict, int]]:
    """The run's TP layer records as the flat rows the checks read, each with its TP regions per
    layer."""
    return [
        (
            {
                "tp": m.tp,
                "sequence_parallel": m.sequence_parallel,
                "step_time_s": m.step_time_s,
                "single_rank_step_time_s": m.single_rank_step_time_s,
                "dtensor_step_time_s": m.dtensor_step_time_s,
                "comm_share": m.comm_share,
                "comm_bytes_per_layer": m.comm_bytes_per_layer,
                "batch": m.micro_batch,
                "seq": m.seq_len,
                "d_model": m.d_model,
                "n_head": m.n_head,
                "n_kv_head": m.n_kv_head,
                "mlp_ratio": m.mlp_ratio,
            },
            tp_regions(m.module),
        )
        for m in inputs.of(contract_records.TpMeasurement)
    ]


def from_tp(rows: list[tuple[dict, int]], src: Source, link: LinkModel | None) -> list[Candidate]:
    if link is None:
        return []
    ratios = []
    for row, regions in rows:
        step, share = finite_number(row.get("step_time_s")), finite_number(row.get("comm_share"))
        if (
            not step
            or share is None
            or int(row.get("tp", 1)) < 2
            or not row.get("comm_bytes_per_layer")
        ):
            continue
        ratios.append(step * share / tp_modelled_comm_s(row, link, regions))
    if not ratios:
        return []
    ratios.sort()
    med = ratios[len(ratios) // 2]
    return [
        Candidate(
            "tp_overhead",
            med,
            src,
            f"median over {len(ratios)} tp>1 rows of measured TP comm time "
            "(profile) / alpha-beta time with this device's measured link",
        )
    ]


def from_cp(layers: list[contract_records.CpMeasurement], src: Source) -> list[Candidate]:
    """cp_overlap: the median over the ring rows of the share of the overlapped K/V sends hidden
    behind attention (tp-attention's CP study: (serial − overlapped) / the sends alone)."""
    shares = sorted(
        m.overlap_fraction for m in layers if m.impl == "ring" and m.overlap_fraction is not None
    )
    if not shares:
        return []
    return [
        Candidate(
            "cp_overlap",
            shares[len(shares) // 2],
            src,
            f"median over {len(shares)} ring layers (cp "
            f"{', '.join(sorted({str(m.cp) for m in layers if m.impl == 'ring'}))}) of the K/V "
            "sends' hidden share",
        )
    ]
