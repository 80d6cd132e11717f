"""The numbers the backtest fits to published rows, and leave-one-source-out.

Two are fitted (least squares on the log error over ``FIT_GRID``): the share of overlapped DP
traffic's time that its NCCL kernel's SMs leave to compute (``dp_overlap``) and the share of the
datasheet link rate collectives reach (``link_efficiency``); a third is measured by pairs of rows,
the share of TP traffic torchtitan's AsyncTP hides (``async_tp_hidden``: a row with it and its
``without`` twin). ``loso_fits``: per source, the fit to every OTHER source's rows.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from .links import default_links
from .hardware import LINK_EFFICIENCY, Cluster
from .calibration import ASYNC_TP_HIDDEN, GPU_DP_OVERLAP, Calibration, Param
from .published_runs import Setup, reported_tps, row_setup
from .step_breakdown import StepTime
from .timemodel import step_time

# The grids the two fitted numbers are chosen from: their physical ranges. NCCL's kernel takes at
# most half of the time it overlaps through its SMs (16-32 CTAs of 108-132 SMs; its HBM traffic is
# priced apart); nccl-tests' bus bandwidth reaches 70-100% of the NVLink and NIC line rates. A fit
# at the edge of a range says the rows want something else.
FIT_GRID = {"dp_overlap": (0.5, 0.6, 0.7, 0.8, 0.9, 1.0), "link_efficiency": (0.7, 0.8, 0.9, 1.0)}


def calibration(fitted: dict) -> tuple[Calibration, object]:
    """(Calibration, link calibration) with the fitted numbers."""
    links = default_links()
    eff = fitted.get("link_efficiency", LINK_EFFICIENCY)
    links = replace(
        links,
        intra_efficiency=replace(links.intra_efficiency, value=eff),
        inter_efficiency=replace(links.inter_efficiency, value=eff),
    )
    calib = replace(
        Calibration(),
        dp_overlap=Param(
            fitted.get("dp_overlap", GPU_DP_OVERLAP),
            "datasheet/published: fitted to the development set",
        ),
    )
    if "async_tp_hidden" in fitted:
        calib = replace(
            calib,
            async_tp_hidden=Param(
                fitted["async_tp_hidden"], "datasheet/published: the other sources' AsyncTP pairs"
            ),
        )
    return calib, links


def predict(s: Setup, fitted: dict) -> tuple[StepTime, Cluster, Calibration]:
    calib, links = calibration(fitted)
    cluster = links.apply(s.cluster)
    return step_time(s.shape, s.layout, cluster, calib, s.precision, stack=s.stack), cluster, calib


def async_tp_shares(rows: tuple[dict, ...], fitted: dict) -> dict[str, float]:
    """Per pair (a row with AsyncTP, its ``without`` twin): the share of TP traffic AsyncTP hid,
    the reported step time it saved over the TP traffic the model prices for the layout without
    it (links as ``fitted``)."""
    by_name = {r["name"]: r for r in rows}
    out = {}
    for r in rows:
        if "without" in r:
            base = by_name[r["without"]]
            s = row_setup(base)
            tps = reported_tps(base, s.shape)
            step = base["layout"]["global_batch"] * s.shape.seq_len / base["gpus"] / tps
            saved = step * (1 - tps / reported_tps(r, row_setup(r).shape))
            out[r["name"]] = saved / predict(s, fitted)[0].tp_comm
    return out


def _async_tp_by_efficiency(
    rows: tuple[dict, ...], group: str | None, pairs: tuple
) -> tuple[tuple[float, float], ...]:
    """((link_efficiency, AsyncTP share), ...) over the grid: the mean share of the pairs outside
    ``group`` (every pair when None), to 2 decimals, the default without any. The TP traffic a
    pair's share is taken of depends on the links' efficiency, so the share is fitted with it.
    ``pairs``: ``_pair_shares(rows)``."""
    out = []
    for eff, shares in pairs:
        keep = [shares[r["name"]] for r in rows if r["name"] in shares and r["group"] != group]
        out.append((eff, round(statistics.mean(keep), 2) if keep else ASYNC_TP_HIDDEN))
    return tuple(out)


def _pair_shares(rows: tuple[dict, ...]) -> tuple[tuple[float, dict], ...]:
    return tuple(
        (eff, async_tp_shares(rows, {"link_efficiency": eff}))
        for eff in FIT_GRID["link_efficiency"]
    )


def _log_errors(
    rows: tuple[dict, ...], async_tp: tuple[tuple[float, float], ...] = (), base: dict | None = None
) -> dict:
    """|log(predicted / reported)| of every row that ran at every grid point: {(dp_overlap, eff):
    [errors]}, in row order, AsyncTP's share per efficiency as ``async_tp`` gives it (the fits
    below only aggregate these, so leave-one-source-out costs one pass, and the AsyncTP rows
    again per other set of shares: pass the first pass as ``base``)."""
    pts = [
        (row_setup(r), reported_tps(r, row_setup(r).shape)) for r in rows if not r.get("expect_oom")
    ]
    share = dict(async_tp)
    out = {}
    for ov in FIT_GRID["dp_overlap"]:
        for eff in FIT_GRID["link_efficiency"]:
            f = {
                "dp_overlap": ov,
                "link_efficiency": eff,
                "async_tp_hidden": share.get(eff, ASYNC_TP_HIDDEN),
            }
            out[ov, eff] = [
                abs(math.log(predict(s, f)[0].tokens_per_s / s.layout.gpus / rep))
                if base is None or s.stack.async_tp
                else base[ov, eff][i]
                for i, (s, rep) in enumerate(pts)
            ]
    return out


def _ranked(errors: dict, keep: list[bool]) -> list[tuple[float, tuple[float, float]]]:
    """(mean squared log error over the kept rows, grid point), best first (ties: the larger
    values)."""
    scored = [
        (round(statistics.fmean(e * e for e, k2 in zip(errors[k], keep) if k2), 9), k)
        for k in errors
    ]
    return sorted(scored, key=lambda m_k: (m_k[0], -m_k[1][0], -m_k[1][1]))


def _best(errors: dict, keep: list[bool]) -> dict:
    """The grid point minimising the mean squared log error over the kept rows (least squares;
    ties: the larger values). Every row pulls on it: a median is flat over a wide band (the
    middle row barely moves), so the leave-one-source-out fits would jump between the band's
    corners from one left-out source to the next."""
    ov, eff = _ranked(errors, keep)[0][1]
    return {"dp_overlap": ov, "link_efficiency": eff}


def fit_with_margin(rows: list[dict]) -> tuple[dict, dict]:
    """(``fit``, how firmly the rows choose it) from one pass over the grid: the fit's mean squared
    log error and the grid's runner-up with its own (a near tie: a small change to any term can
    flip the fit, and the leave-one-source-out folds with it)."""
    ran = tuple(r for r in rows if not r.get("expect_oom"))
    shares = _async_tp_by_efficiency(ran, None, _pair_shares(ran))
    (mse, best), (next_mse, runner_up) = _ranked(_log_errors(ran, shares), [True] * len(ran))[:2]
    fitted = {
        "dp_overlap": best[0],
        "link_efficiency": best[1],
        "async_tp_hidden": dict(shares)[best[1]],
    }
    margin = {
        "mse": mse,
        "runner_up": {"dp_overlap": runner_up[0], "link_efficiency": runner_up[1]},
        "runner_up_mse": next_mse,
    }
    return fitted, margin


def fit_margin(rows: list[dict]) -> dict:
    """``fit_with_margin``'s margin."""
    return fit_with_margin(rows)[1]


def fit(rows: list[dict]) -> dict:
    """The grid point minimising the mean squared log error over ``rows`` (ties: the larger
    values), with AsyncTP's share from every pair at its link efficiency."""
    return fit_with_margin(rows)[0]


def loso_fits(rows: tuple[dict, ...]) -> dict[str, dict]:
    """Per source (``group``): the fit to every OTHER source's rows, AsyncTP's share from the
    OTHER sources' pairs."""
    ran = tuple(r for r in rows if not r.get("expect_oom"))
    groups = sorted({r["group"] for r in rows})
    pairs = _pair_shares(ran)
    shares = {g: _async_tp_by_efficiency(ran, g, pairs) for g in groups}
    first, *rest = sorted(set(shares.values()))
    errors = {first: _log_errors(ran, first)}
    errors.update({v: _log_errors(ran, v, errors[first]) for v in rest})
    out = {}
    for g in groups:
        best = _best(errors[shares[g]], [r["group"] != g for r in ran])
        out[g] = {**best, "async_tp_hidden": dict(shares[g])[best["link_efficiency"]]}
    return out
