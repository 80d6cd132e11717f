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

Launch-bound cases are floored with their own session's host where it was measured: its issue
time per launch (``session_host_s``) and its FSDP2 hooks per unit (``session_unit_launches``).
Where a profile's host issued the step faster than the GPU ran it, the step less the kernels'
union is the GPU's idle time, which the model does not price (``Scored.gpu_idle_s``); the summary
reports it per counted launch beside the predicted GPU work's excess over the kernels. Not for the
records of 2026-11-27 (``Case.lambdas_dropped``): they lack every kernel named after a lambda
(``gpucheck.timeline.annotation_name``), so their union is short of the GPU's work by those
kernels and the difference is no idle time. What it prints: ``backtest_measured_text``.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .calibration import Calibration
from .compute import head_s
from .eager import dispatch_floor_s, host_launches, host_op_s, kernel_counts
from .efficiency import head_gemm
from .hardware import Cluster, get_profile
from .measured_cases import Case, measured_cases
from .stack_memory import memory_for
from .shapes import Layout
from .device_rates import device_of
from .timemodel import step_time

WITHIN = 0.10  # the issue's goal: every run within 10% on time and memory
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
    unit_launches: float | None = None  # FSDP2's hooks per unit from its host's own probe

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


def session_dir(case: Case) -> Path | None:
    """The folder of the session a case was measured in (``session_of``), None if none."""
    parts = Path(case.source).parts
    at = next((i for i, p in enumerate(parts) if p.startswith(("gpu-check-", "probe-"))), None)
    return None if at is None else Path(*parts[: at + 1])


def session_unit_launches(cases: list[Case]) -> dict[str, float]:
    """Each session's FSDP2 hook work per unit where its GPU's host was probed
    (``host/fsdp_host*.json``: ``python -m dtrain.gpucheck.fsdp_host --plain-autocast`` on that
    host's CPU): the launch equivalents, against the plain step under autocast as the model's
    launch counts are, median over its probes. Cases of that session take it instead of
    eager.yaml's ``fsdp2_unit``, another CPU's: a host's own measurement, as ``session_host_s``."""
    out: dict[str, float] = {}
    for folder in {d for d in map(session_dir, cases) if d is not None}:
        found = []
        for f in sorted((folder / "host").glob("fsdp_host*.json")):
            try:
                probe = json.loads(f.read_text())
                fsdp2 = probe.get("fsdp") == 2 and probe.get("plain") == "autocast"
                launches = float(probe["launch_equivalents"]) if fsdp2 else None
            except (OSError, ValueError, TypeError, KeyError, AttributeError):
                continue  # a probe that cannot be read prices nothing
            if launches is not None and launches > 0:
                found.append(launches)
        if found:
            out[folder.name] = statistics.median(found)
    return out


def counted_launches(case: Case, unit_launches: float | None = None) -> float:
    """What the model says the case's host issues in one step (``eager.host_launches``;
    ``unit_launches``: its host's own FSDP2 probe, ``session_unit_launches``)."""
    counts = kernel_counts(
        case.shape, case.layout, case.structure, case.stack.optimizer, eager_fp8(case)
    )
    return host_launches(case.shape, case.layout, counts, unit_launches)


def eager_fp8(case: Case) -> bool:
    """An FP8 case of the eager stack: torchao's casts are launches of its own."""
    return case.precision == "fp8" and case.stack.fp8_casts == "eager"


def session_host_s(cases: list[Case]) -> dict[str, float]:
    """Each session's host issue time per launch where its profiles timed the host: the median
    over its eager_sweep cases (else its other profile cases) of the host's time per
    ``counted_launches``, as eager.yaml's ``host_op_s`` is derived. That time is the step's own
    issue at a short sequence (``host_issue_s``) where the session measured it, else its
    ``cpu_dispatch_s``, which in a GPU-bound step includes the host's waits on the GPU. Every case
    of that session, its trainer runs too, is floored with it: a host's issue time, not
    another's. FP8 cases do not count: their host waits on the GPU (the 7B/4-layer FP8 step issues
    2,851 launches at 54 us each, more than the driver queues ahead of a GPU-bound step)."""
    timed: dict[str, dict[tuple[bool, bool], list[float]]] = {}
    for c in cases:
        host = c.host_issue_s or c.cpu_dispatch_s
        if host and session_of(c) and c.precision != "fp8":
            key = (c.host_issue_s is not None, c.name.startswith("eager_sweep"))
            per = host / counted_launches(c)
            timed.setdefault(session_of(c), {}).setdefault(key, []).append(per)
    return {s: statistics.median(by[max(by)]) for s, by in timed.items()}


def score(case: Case, host_s: float | None = None, unit_launches: float | None = None) -> Scored:
    """``host_s``: the case's own host's issue time per launch (``session_host_s``); None:
    eager.yaml's for its GPU, another host's. ``unit_launches``: its host's FSDP2 probe
    (``session_unit_launches``); None: eager.yaml's."""
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
    counts = kernel_counts(
        case.shape, case.layout, case.structure, case.stack.optimizer, eager_fp8(case)
    )
    host = host_s or host_op_s(case.gpu)[0]
    floor, total = 0.0, t.total
    if t.kernels:  # as timemodel.step_time prices it, with this case's structure and host
        floor = dispatch_floor_s(counted_launches(case, unit_launches), host)
        total = max(t.gpu_work, floor)
    kernels = {}
    if case.kernels:
        got = measured_categories(case, case.kernels)
        kernels = {k: (int(got[k]), counts.get(k, 0)) for k in CATEGORIES}
        kernels["total"] = (sum(int(v) for v in case.kernels.values()), sum(counts.values()))
    bound = bool(floor) and floor >= total
    measured = host_s is not None
    unit = unit_launches if case.layout.zero_stage >= 2 else None
    return Scored(
        case, total, mem, bound, floor, by_cat, kernels, sum(pred.values()), measured, unit
    )


# the step profile's categories as the term-by-term summary groups them: the logits' fp32 cast is
# the model's loss and the profile's elementwise, so the two are compared together
TERM_GROUPS = {
    "gemm": ("gemm",),
    "attention": ("attention",),
    "elementwise+loss": ("elementwise", "loss"),
    "optimizer": ("optimizer",),
}


def term_ratios(rows: list[Scored]) -> dict[str, dict]:
    """Per ``TERM_GROUPS`` group: the predicted GPU seconds over the measured ones, less 1 (median,
    range, profiles), over the profiles whose records hold every kernel once
    (``Case.complete_records``): where the model's terms are right and where they offset."""
    out = {}
    for group, cats in TERM_GROUPS.items():
        ratios = []
        for r in rows:
            if not (r.case.complete_records and r.by_category):
                continue
            m = sum(r.by_category[k][0] for k in cats)
            p = sum(r.by_category[k][1] for k in cats)
            if m > 0:
                ratios.append(p / m - 1)
        if ratios:
            out[group] = {
                "median": statistics.median(ratios),
                "range": [min(ratios), max(ratios)],
                "profiles": len(ratios),
            }
    return out


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
        "terms": term_ratios(rows),
    }


def backtest_measured(folder: str) -> list[Scored]:
    cases = measured_cases(folder)
    hosts, units = session_host_s(cases), session_unit_launches(cases)
    return [score(c, hosts.get(session_of(c)), units.get(session_of(c))) for c in cases]
