"""`dtrain backtest --measured [DIR]`: the cost model against this project's own GPU runs.

Every CUDA measurement under DIR (default ``measured/``; ``measured_cases``) is predicted with the
cost model as it stands (kernel tables, ``eager.py``'s launch terms, no number taken from the runs'
step times): the step time and peak memory against the measured ones, and, where a step profile
measured them, the predicted GPU seconds and kernel launches by the profile's categories:

  gemm         the layers' GEMMs + the output projection's (``compute.head_s``'s GEMM part)
  attention    the attention term
  elementwise  the memory-bound term (the profile's memcpy / memset folded in)
  loss         the output layer's cross-entropy (``head_s`` less its GEMMs)
  optimizer    AdamW and gradient clipping

Where a profile's host issued the step faster than the GPU ran it, the step less the kernels'
union is the GPU's idle time, which the model does not price (``Scored.gpu_idle_s``); the summary
reports it per counted launch beside the predicted GPU work's excess over the kernels. Not for the
records of 2026-11-27 (``Case.lambdas_dropped``): they lack every kernel named after a lambda
(``gpucheck.timeline.annotation_name``), so their union is short of the GPU's work by those
kernels and the difference is no idle time.
"""

from __future__ import annotations

import json
import statistics
import textwrap
from pathlib import Path
from dataclasses import dataclass, field

from .calibration import Calibration
from .compute import head_s
from .eager import dispatch_floor_s, host_launches, host_op_s, kernel_counts
from .efficiency import head_gemm
from .hardware import GiB, Cluster, get_profile
from .measured_cases import Case, measured_cases
from .stack_memory import memory_for
from .shapes import Layout
from .device_rates import device_of
from .timemodel import step_time

WITHIN = 0.10  # the goal: every run within 10% on time and memory
CATEGORIES = ("gemm", "attention", "elementwise", "loss", "optimizer")


@dataclass(frozen=True)
class Scored:
    case: Case
    predicted_s: float | None
    predicted_mem_bytes: float
    launch_bound: bool = False
    dispatch_floor_s: float = 0.0
    by_category: dict = field(default_factory=dict)  # category -> (measured s, predicted s)
    kernels: dict = field(default_factory=dict)  # category -> (measured, predicted) launches
    gpu_work_s: float = 0.0  # the predicted GPU seconds (every category's, summed)
    host_measured: bool = False  # the floor is its own session's host issue time (session_host_s)

    @property
    def host_per_launch_s(self) -> float | None:
        """The host's measured issue time (a new profile's cpu_dispatch_s) per launch the model
        counts, as eager.yaml's host_op_s is derived (the records may lack kernels)."""
        n = self.kernels.get("total", (0, 0))[1]
        return self.case.cpu_dispatch_s / n if self.case.cpu_dispatch_s and n else None

    @property
    def gpu_idle_s(self) -> float | None:
        """The GPU's measured idle time in a GPU-bound step (a new profile: the step less the
        union of its kernel intervals, where the host issued the step faster than the GPU ran
        it); None where the profile or host time is missing or the host was the slower."""
        c = self.case
        if c.gpu_busy_s is None or c.cpu_dispatch_s is None or c.cpu_dispatch_s >= c.gpu_busy_s:
            return None
        if c.lambdas_dropped:  # its busy union lacks kernels: the difference is no idle time
            return None
        return c.step_s - c.gpu_busy_s

    @property
    def gpu_work_excess(self) -> float | None:
        """The predicted GPU work over the measured kernels' union, less 1 (GPU-bound profiles)."""
        if self.gpu_idle_s is None or not self.gpu_work_s:
            return None
        return self.gpu_work_s / self.case.gpu_busy_s - 1

    @property
    def error(self) -> float | None:
        return None if self.predicted_s is None else self.predicted_s / self.case.step_s - 1

    @property
    def memory_error(self) -> float | None:
        m = self.case.peak_mem_bytes
        return self.predicted_mem_bytes / m - 1 if m else None


def categories(case: Case, cluster: Cluster, t) -> dict[str, float]:
    """Predicted GPU seconds of one step by the step profile's categories."""
    dev = device_of(cluster, Calibration(), case.stack)
    one = Layout(micro_batch=case.layout.micro_batch)
    m = case.layout.grad_accum
    gemm_head = 3 * dev.gemm_s(head_gemm(case.shape, one)) * m
    loss = head_s(case.shape, one, dev) * m - gemm_head
    c = t.terms
    return {
        "gemm": c.gemm + gemm_head,
        "attention": c.attention,
        "elementwise": c.memory,
        "loss": loss,
        "optimizer": c.optimizer,
    }


def measured_categories(case: Case, values: dict) -> dict[str, float]:
    out = {k: float(values.get(k, 0.0)) for k in CATEGORIES}
    out["elementwise"] += float(values.get("memcpy", 0.0))
    return out


def session_of(case: Case) -> str:
    """The gpu-check or probe session a case was measured in (its folder's name), '' if none."""
    parts = Path(case.source).parts
    return next((p for p in parts if p.startswith(("gpu-check-", "probe-"))), "")


def counted_launches(case: Case) -> float:
    """What the model says the case's host issues in one step (``eager.host_launches``)."""
    counts = kernel_counts(case.shape, case.layout, case.structure, case.stack.optimizer)
    return host_launches(case.shape, case.layout, counts)


def session_host_s(cases: list[Case]) -> dict[str, float]:
    """Each session's host issue time per launch where its profiles timed the host
    (``cpu_dispatch_s``): the median over its eager_sweep cases (else its other profile cases) of
    cpu_dispatch_s / ``counted_launches``, as eager.yaml's ``host_op_s`` is derived. Every case of
    that session, its trainer runs too, is floored with it: a host's issue time, not another's."""
    timed: dict[str, dict[bool, list[float]]] = {}
    for c in cases:
        if c.cpu_dispatch_s and session_of(c):
            sweep = c.name.startswith("eager_sweep")
            per = c.cpu_dispatch_s / counted_launches(c)
            timed.setdefault(session_of(c), {}).setdefault(sweep, []).append(per)
    return {s: statistics.median(by.get(True) or by[False]) for s, by in timed.items()}


def score(case: Case, host_s: float | None = None) -> Scored:
    """``host_s``: the case's own host's issue time per launch (``session_host_s``); None:
    eager.yaml's for its GPU, another host's."""
    cluster = Cluster.from_profile(get_profile(case.gpu), case.layout.gpus, 8)
    mem = memory_for(case.shape, case.layout, case.stack, precision=case.precision).total
    if case.not_modelled:
        return Scored(case, None, mem)
    t = step_time(case.shape, case.layout, cluster, Calibration(), case.precision, stack=case.stack)
    pred = categories(case, cluster, t)
    by_cat = (
        {k: (v, pred[k]) for k, v in measured_categories(case, case.gpu_s).items()}
        if case.gpu_s
        else {}
    )
    # the floor with the case's own structure (biases, learned positions), as the plan cannot
    counts = kernel_counts(case.shape, case.layout, case.structure, case.stack.optimizer)
    host = host_s or host_op_s(case.gpu)[0]
    floor = 0.0
    if t.kernels:  # as timemodel.step_time prices it: kernels and FSDP2's hooks
        floor = dispatch_floor_s(counted_launches(case), host)
    total = max(t.total, floor)
    kernels = {}
    if case.kernels:
        got = measured_categories(case, case.kernels)
        kernels = {k: (int(got[k]), counts.get(k, 0)) for k in CATEGORIES}
        kernels["total"] = (sum(int(v) for v in case.kernels.values()), sum(counts.values()))
    bound = bool(floor) and floor >= total
    measured = host_s is not None
    return Scored(case, total, mem, bound, floor, by_cat, kernels, sum(pred.values()), measured)


def phase_text(phases: dict) -> str:
    """A profile's phases as 'forward 12.0/30.1 ...' (host ms / GPU ms; '-' where no GPU)."""

    def ms(v) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    return " ".join(f"{k} {ms(v.get('host_s'))}/{ms(v.get('gpu_s'))}" for k, v in phases.items())


def summary(rows: list[Scored]) -> dict:
    errs = [abs(r.error) for r in rows if r.error is not None]
    dropped = sum(r.case.lambdas_dropped for r in rows)
    mems = [abs(r.memory_error) for r in rows if r.memory_error is not None]
    idle = [r for r in rows if r.gpu_idle_s is not None and r.kernels]
    per_launch = [r.gpu_idle_s / r.kernels["total"][1] for r in idle]
    excess = [r.gpu_work_excess for r in idle]
    return {
        "gpu_bound_profiles": len(idle),
        "profiles_lacking_lambda_kernels": dropped,
        "gpu_idle_per_launch_median_s": statistics.median(per_launch) if per_launch else None,
        "gpu_idle_per_launch_range_s": [min(per_launch), max(per_launch)] if per_launch else None,
        "gpu_work_excess_median": statistics.median(excess) if excess else None,
        "gpu_work_excess_range": [min(excess), max(excess)] if excess else None,
        "runs": len(rows),
        "time_scored": len(errs),
        "time_within_10pct": sum(e <= WITHIN for e in errs),
        "time_median_abs_error": statistics.median(errs) if errs else None,
        "memory_scored": len(mems),
        "memory_within_10pct": sum(e <= WITHIN for e in mems),
        "memory_median_abs_error": statistics.median(mems) if mems else None,
        "not_modelled": sum(bool(r.case.not_modelled) for r in rows),
    }


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.0%}"


SHORT = {
    "gemm": "gemm",
    "attention": "attn",
    "elementwise": "elem",
    "loss": "loss",
    "optimizer": "opt",
    "total": "all",
}


def text_lines(rows: list[Scored], width: int = 100) -> list[str]:
    """The table (within ``width`` columns) and its one-line summary."""
    wrap = textwrap.TextWrapper(
        width, break_long_words=False, initial_indent="  ", subsequent_indent="    "
    )
    out = [
        f"{'run':<46} {'gpu':<8} {'ms':>6} {'pred':>6} {'err':>5} {'GiB':>5} {'pred':>5} "
        f"{'err':>5} {'b':>1}"
    ]
    for r in rows:
        c = r.case
        mem = f"{c.peak_mem_bytes / GiB:5.1f}" if c.peak_mem_bytes else f"{'':>5}"
        pred = f"{r.predicted_s * 1e3:6.1f}" if r.predicted_s is not None else f"{'-':>6}"
        ms = f"{c.step_s * 1e3:6.1f}" if c.step_s else f"{'OOM':>6}"
        out.append(
            f"{c.name[:46]:<46} {c.gpu:<8} {ms} {pred} {_pct(r.error):>5} {mem} "
            f"{r.predicted_mem_bytes / GiB:5.1f} {_pct(r.memory_error):>5} "
            f"{'L' if r.launch_bound else ''}"
        )
        if c.not_modelled and not c.step_s:  # the case did not run: does the model say so?
            fits = r.predicted_mem_bytes <= get_profile(c.gpu).hbm_bytes
            out += wrap.wrap(
                f"{c.not_modelled}; the model: {r.predicted_mem_bytes / GiB:.1f} GiB, "
                + ("fits (wrong)" if fits else "does not fit (right)")
            )
        elif c.not_modelled:
            out.append(f"  not predicted: {c.not_modelled}")
        out += wrap.wrap(f"note: {c.note}") if c.note else []
        if r.launch_bound and not r.host_measured:
            out += wrap.wrap(
                "floor: this host's issue time was not measured; priced at eager.yaml's "
                f"{host_op_s(c.gpu)[0] * 1e6:.1f} us per launch, another host's"
            )
        if r.by_category:
            out += wrap.wrap(
                "GPU ms m/p: "
                + " ".join(
                    f"{SHORT[k]} {m * 1e3:.1f}/{p * 1e3:.1f}" for k, (m, p) in r.by_category.items()
                )
            )
        if r.kernels:
            out += wrap.wrap(
                "kernels m/p: "
                + " ".join(f"{SHORT[k]} {m}/{p}" for k, (m, p) in r.kernels.items())
                + f"; floor {r.dispatch_floor_s * 1e3:.0f} ms"
            )
        if c.gpu_kernel_sum_s is not None and c.gpu_busy_s is not None:  # a new profile's union
            out += wrap.wrap(
                ("GPU busy at least " if c.lambdas_dropped else "GPU busy ")
                + f"{c.gpu_busy_s * 1e3:.1f} ms of the step measured (kernels "
                f"{c.gpu_kernel_sum_s * 1e3:.1f} ms summed"
                + (
                    "; the records lack the kernels named after a lambda"
                    if c.lambdas_dropped
                    else ""
                )
                + f"); predicted GPU work {r.gpu_work_s * 1e3:.1f} ms"
                + (
                    f"; GPU idle {r.gpu_idle_s * 1e3:.1f} ms (not priced)"
                    if r.gpu_idle_s is not None
                    else ""
                )
            )
        if c.phases:
            out += wrap.wrap("phases host/GPU ms: " + phase_text(c.phases))
        if c.largest_gaps:
            out += wrap.wrap(
                "longest GPU gaps: "
                + "; ".join(
                    f"{g['gap_s'] * 1e3:.2f} ms after {g['after'][:32]} before {g['before'][:32]}"
                    for g in c.largest_gaps[:3]
                )
            )
        if r.host_per_launch_s is not None:
            out += wrap.wrap(
                f"host issue m/p: {c.cpu_dispatch_s * 1e3:.1f}/"
                f"{r.dispatch_floor_s * 1e3:.1f} ms; "
                f"{r.host_per_launch_s * 1e6:.1f} us per counted launch measured "
                f"(cpu_dispatch_s / the model's launches)"
            )
    s = summary(rows)
    med, mmed = s["time_median_abs_error"], s["memory_median_abs_error"]
    notes = (
        "ms: measured step, pred: the cost model's (eager stack: costmodel/eager.py); GiB: the "
        "run's peak memory (CUDA max allocated) where recorded; b: L = launch-bound. Step "
        "profiles (m/p: measured/predicted): elem includes memcpy/memset, loss includes the "
        "logits' fp32 cast on the model's side (the profile files it under elem); an old profile "
        "sums some kernels twice (its "
        "categories can add up to more than the step: the optimizer's, by about 2x); floor = "
        "the host's issue (kernel launches, + FSDP2's hooks per unit, x the host's seconds "
        "per launch, eager.yaml)."
    )
    summary_line = (
        f"summary: time within {WITHIN:.0%}: {s['time_within_10pct']} of {s['time_scored']}"
        + (f" (median |error| {med:.1%})" if med is not None else "")
        + f"; memory within {WITHIN:.0%}: {s['memory_within_10pct']} of {s['memory_scored']}"
        + (f" (median |error| {mmed:.1%})" if mmed is not None else "")
        + (f"; {s['not_modelled']} not predicted" if s["not_modelled"] else "")
    )
    tail = textwrap.TextWrapper(width, break_long_words=False, subsequent_indent="  ")
    return out + [""] + tail.wrap(notes) + tail.wrap(summary_line) + tail.wrap(idle_line(s))


def idle_line(s: dict) -> str:
    """What the GPU-bound profiles say of the GPU's idle time, which the model does not price:
    the predicted GPU work runs above the kernels' union by about as much (a compensation the
    closing notes of issue 39 name; not a term)."""
    lacking = s.get("profiles_lacking_lambda_kernels")
    why = (
        f"{lacking} profiles' kernel records lack every kernel named after a lambda (dtype casts,"
        " GELU, most reductions: the 2026-11-27 records, gpucheck/timeline.annotation_name), so"
        " their GPU busy time, elementwise and loss seconds are lower bounds and their idle is not"
        " measured"
        if lacking
        else ""
    )
    if not s["gpu_bound_profiles"]:
        return why
    lo, hi = s["gpu_idle_per_launch_range_s"]
    elo, ehi = s["gpu_work_excess_range"]
    return (
        f"GPU idle in the {s['gpu_bound_profiles']} GPU-bound profiles with kernel records: "
        f"median {s['gpu_idle_per_launch_median_s'] * 1e6:.1f} us per counted launch "
        f"({lo * 1e6:.1f}-{hi * 1e6:.1f}), not priced; the predicted GPU work is "
        f"{s['gpu_work_excess_median']:+.0%} ({elo:+.0%} to {ehi:+.0%}) of the kernels' union"
        + (f"; {why}" if why else "")
    )


def as_json(rows: list[Scored]) -> dict:
    def one(r: Scored) -> dict:
        c = r.case
        return {
            "name": c.name,
            "source": c.source,
            "gpu": c.gpu,
            "stack": c.stack.describe(),
            "layout": {"micro_batch": c.layout.micro_batch, "gpus": c.layout.gpus},
            "seq_len": c.shape.seq_len,
            "measured_step_s": c.step_s,
            "predicted_step_s": r.predicted_s,
            "error": r.error,
            "measured_peak_mem_bytes": c.peak_mem_bytes,
            "predicted_mem_bytes": r.predicted_mem_bytes,
            "memory_error": r.memory_error,
            "launch_bound": r.launch_bound,
            "host_measured": r.host_measured,
            "dispatch_floor_s": r.dispatch_floor_s,
            "host_per_launch_s": r.host_per_launch_s,
            "predicted_gpu_work_s": r.gpu_work_s,
            "gpu_busy_s": c.gpu_busy_s,
            "gpu_kernel_sum_s": c.gpu_kernel_sum_s,
            "cpu_dispatch_s": c.cpu_dispatch_s,
            "gpu_s_by_category": {
                k: {"measured": m, "predicted": p} for k, (m, p) in r.by_category.items()
            },
            "kernels_by_category": {
                k: {"measured": m, "predicted": p} for k, (m, p) in r.kernels.items()
            },
            "phases": c.phases or None,
            "largest_gaps": c.largest_gaps or None,
            "not_modelled": c.not_modelled or None,
            "note": c.note or None,
        }

    return {"runs": [one(r) for r in rows], "summary": summary(rows)}


def backtest_measured(folder: str) -> list[Scored]:
    cases = measured_cases(folder)
    hosts = session_host_s(cases)
    return [score(c, hosts.get(session_of(c))) for c in cases]


def run(folder: str, as_json_out: bool = False) -> int:
    rows = backtest_measured(folder)
    if as_json_out:
        print(json.dumps(as_json(rows), indent=2, sort_keys=True))
    else:
        print("\n".join(text_lines(rows)))
    return 0
