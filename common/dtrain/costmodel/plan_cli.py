"""`dtrain plan`: the best DP×TP×PP layout for one model on one cluster, and why.

    dtrain plan --params 70e9 --gpus 512 --gpus-per-node 8 --nvlink-gbps 900 --ib-gbps 400
    dtrain plan --params 405e9 --gpus 2048 --layout "tp=8 pp=16 v=8 zero=1 recompute=selective mb=1"

``--layout`` scores a layout you already run: the fields given are fixed, the rest searched, and
the answer says how far it is from the unconstrained best.

Units are the ones printed on datasheets, converted once (``plan_inputs.cluster_from_args``):
  --nvlink-gbps  GB/s (bytes) per GPU, BOTH directions added (H100 SXM: 900, A100: 600); the model
                 uses half of it, the per-direction rate that nccl-tests' bus bandwidth approaches.
  --ib-gbps      Gbit/s (bits) per GPU, the NIC line rate (NDR 400, HDR 200); ÷8 gives GB/s.
Exit codes: 0 a plan was found, 1 nothing fits in memory, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from dtrain.core import terminal
from dtrain.core.errors import UserError

from .plan_header import calibration_notes
from .plan_json import layout_json, plan_dict, to_json
from .plan_runnable import Runnable, runnable_text
from .plan_text import framework_gap, framework_text, layout_text, res_usable, text_report
from .plan_wrap import fit_lines
from .search import SearchResult, search
from .explain_tp import explain_tp, explain_tp_json
from .plan_args import EPILOG, add_arguments
from .plan_inputs import cluster_from_args, global_batch_of, shape_from_args, stack_of
from .plan_layout import layout_result, pinned_layout
from . import moe_cli


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="choose DP x TP x PP, ZeRO stage, recompute and micro-batch for a model",
        description=__doc__.split("\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def check_batch_splits(result: SearchResult) -> None:
    """A global batch that no layout's data-parallel replicas can share (each needs whole
    sequences) is bad input, not a cluster too small: more GPUs only add replicas. Names the least
    dp a layout has."""
    rejected = result.rejected_with_reasons
    if result.best is not None or not rejected:
        return
    if not all(isinstance(why, str) and why.startswith("global batch") for _, why in rejected):
        return  # something was rejected for memory: the report says what does not fit
    batch, gpus = result.global_batch, result.cluster.gpus
    least = min(lay.dp for lay, _ in rejected)
    replicas = f"replica{'s' * (batch > 1)}"
    fits = (
        f"a global batch of {batch} feeds at most {batch} data-parallel {replicas}"
        if batch < least
        else f"{batch} is not a multiple of any of their dp"
    )
    raise UserError(
        f"--global-batch {batch} cannot be split over {gpus} GPUs: every layout of this model has "
        f"at least dp={least} data-parallel replicas (tp, cp and pp are bounded by its heads, "
        f"sequence and layers) and {fits}: give a --global-batch that is a multiple of {least}, "
        "or fewer --gpus"
    )


def runnable(result: SearchResult, a, calib, cluster) -> Runnable:
    """Whether the trainer runs the choice's overrides as printed (its own checks:
    ``overrides.trainer_refusal``); when not, the search again restricted to ``--software
    dtrain``, whose best it runs."""
    from .overrides import train_overrides, trainer_refusal

    if result.best is None:
        return Runnable()
    overrides, _ = train_overrides(result.best, result.model, result.global_batch, a.precision)
    why = trainer_refusal(overrides)
    if why is None:
        return Runnable()
    alt = search(
        result.model,
        cluster,
        result.global_batch,
        calib,
        precision=a.precision,
        headroom=a.headroom,
        # the trainer runs neither TE's overlap nor AsyncTP
        stack=replace(stack_of(a), software="dtrain", tp_overlap=False, async_tp=False),
    )
    return Runnable(why, alt)


def run(a) -> int:
    from .links import default_links

    a.global_batch = global_batch_of(a)
    shape, datasheet = shape_from_args(a), cluster_from_args(a)
    moe_cli.check_precision(a.precision, datasheet.gpu.name)
    if a.experts is None:
        moe_cli.refuse_moe_flags(a)
        a.precision = "fp8" if a.precision == "mxfp8" else a.precision  # priced as FP8
    if a.precision == "fp8" and datasheet.gpu.fp8_tflops is None:
        raise UserError(f"{datasheet.gpu.name} has no FP8 tensor cores: use --precision bf16")
    notes = ["calibration: datasheet/published values (pass --results DIR to use measured ones)"]
    calib = None
    cluster = default_links().apply(datasheet)
    if a.results:
        from .calibrate import (
            calibrate_naming_skips,
        )  # reads run directories: pandas, only when asked

        report, skipped = calibrate_naming_skips(a.results, gpu=datasheet.gpu.name)
        for message in skipped:
            print(f"warning: {message}", file=sys.stderr)
        calib, cluster = report.cluster, report.cluster_links.apply(datasheet)
        notes = calibration_notes(report) + [f"  skipped: {m}" for m in skipped]
    stack, fixed = stack_of(a), pinned_layout(a, datasheet.gpus, shape)
    if a.experts is not None:
        return moe_cli.run(a, shape, cluster, calib, stack, fixed)
    result = search(
        shape,
        cluster,
        a.global_batch,
        calib,
        precision=a.precision,
        headroom=a.headroom,
        stack=stack,
    )
    check_batch_splits(result)
    run_it = runnable(result, a, calib, cluster)
    mine, gap, tight = layout_result(shape, cluster, a, calib, result, fixed)
    free = (
        None
        if stack.software == "any"
        else search(
            shape,
            cluster,
            a.global_batch,
            calib,
            precision=a.precision,
            headroom=a.headroom,
            stack=replace(stack, software="any"),
        )
    )
    if a.json:
        out = to_json(result, a.top, notes, run_it)
        if free is not None:
            out["any_framework"] = {
                "choice": plan_dict(free.best, free) if free.best else None,
                "faster_pct": framework_gap(result, free),
            }
        if mine is not None:
            out["layout"] = layout_json(mine, gap, a.layout, tight)
        if a.explain_tp:
            out["explain_tp"] = explain_tp_json(result)
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        lines = text_report(result, a.top, notes, runnable_text(result, run_it))
        if free is not None:
            lines += [""] + framework_text(result, free)
        if mine is not None:
            lines += [""] + layout_text(mine, gap, a.layout, res_usable(mine), tight)
        if a.explain_tp:
            lines += [""] + explain_tp(result)[0]
        print("\n".join(fit_lines(lines, terminal.width())))
    if mine is not None and mine.best is None:
        print(
            f'error: your layout "{a.layout}" cannot run: {mine.reason}: change --layout (the '
            "report above "
            "shows the best layout)",
            file=sys.stderr,
        )
        return 2
    if result.best is None:
        if not a.json:
            print(
                "hint: more GPUs, a GPU with more memory (--gpu), or a shorter --seq",
                file=sys.stderr,
            )
        return 1
    return 0
