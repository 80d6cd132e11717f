"""What ``dtrain backtest --measured`` scores: every CUDA measurement under a folder, read as
``Case``s (model, layout, stack, GPU, the measured step and memory, and where a step profile
gives them the GPU seconds and kernel launches by category).

Two sources:
  gpu-check reports   ``report.json`` (a list of steps, ``make gpu-check``): the cases of its
                      ``step_profile`` and ``eager_sweep`` steps, one training step of dtrain's GPT
                      on one GPU, eager, under the profiler; and a lone ``step_profile.json`` (a
                      probe session's copy of that step). Fields a report lacks (older ones have
                      no ``peak_mem_bytes``, ``gpu_kernel_sum_s``, ``kernels_by_category``) are
                      left None and not scored
  trainer runs        run directories (``dtrain.results.loader``) whose summary holds a
                      ``training`` record (``dtrain.results.contract``) measured on CUDA; their
                      config says whether the model was compiled
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from dtrain.core.errors import UserError
from dtrain.core.files import files_named
from dtrain.model.args import GPTConfig
from dtrain.results import contract, contract_records
from dtrain.results.loader import complete_runs

from .eager import SOFTWARE as EAGER, Structure
from .gpt_shape import shape_of
from .hardware import gpu_profile_name
from .shapes import Layout, ModelShape
from .stack import Stack

PROFILE_STEPS = ("step_profile", "eager_sweep")
# SDPA's backend names in a case's "attention" field -> the kernel table's (stack.ATTENTION_KERNELS)
ATTENTION = {
    "flash": "flash2",
    "flash2": "flash2",
    "flash_attention_2": "flash2",
    "cudnn": "flash",
    "default": "flash",
    "sdpa": "flash",  # the new profiles name the API: SDPA picks its default backend
    "math": "eager",
    "eager": "eager",
}
# dtrain's GPT runs SDPA's default backend, on Hopper cuDNN's fused attention ("flash")
DEFAULT_ATTENTION = "flash"
# fp8-train recipes the cost model prices: the precision and FP8 scaling they run
RECIPES = {None: "bf16", "bf16": "bf16", "torchao_tensorwise": "fp8"}


@dataclass(frozen=True)
class Case:
    """One measured step and what the model needs to predict it."""

    name: str
    source: str  # the file it came from
    gpu: str  # hardware.yaml profile
    shape: ModelShape
    structure: Structure
    layout: Layout
    stack: Stack
    precision: str
    step_s: float
    peak_mem_bytes: float | None = None
    gpu_s: dict = field(default_factory=dict)  # category -> GPU seconds (profile cases)
    kernels: dict = field(default_factory=dict)  # category -> launches (profile cases)
    gpu_busy_s: float | None = None
    gpu_kernel_sum_s: float | None = None
    cpu_dispatch_s: float | None = None
    # the host's issue time of the same step at a short sequence (stepprof.host_issue_s): its
    # own, where cpu_dispatch_s of a GPU-bound step includes waiting on the GPU
    host_issue_s: float | None = None
    not_modelled: str = ""  # why the time is not predicted (a recipe the model has no terms for)
    note: str = ""  # what the prediction prices only in part
    phases: dict = field(default_factory=dict)  # phase -> {host_s, gpu_s} (stepprof's phases)
    largest_gaps: list = field(default_factory=list)  # the profile's longest GPU idle gaps
    top_kernels: list = field(default_factory=list)  # its kernels with the most GPU time, by name
    # its kernel records lack the kernels named after a lambda (timeline.annotation_name: the
    # 2026-11-27 records): GPU busy, idle and the elementwise and loss seconds are lower bounds
    lambdas_dropped: bool = False
    # its records hold every kernel once (timeline.RECORDS_VERSION 2): categories to compare
    complete_records: bool = False


def gpt_case_shape(cfg: GPTConfig, seq_len: int | None = None) -> tuple[ModelShape, Structure]:
    """dtrain's GPT as the cost model sees it: learned positions (no RoPE), biases as configured."""
    shape = replace(shape_of(cfg), rotary=False, name="")
    if seq_len:
        shape = replace(shape, seq_len=int(seq_len))
    return shape, Structure(bias=bool(cfg.bias), learned_positions=True)


def eager_stack(attention: str = DEFAULT_ATTENTION, optimizer: str = "foreach") -> Stack:
    return Stack(attention, "eager", "eager", software=EAGER, optimizer=optimizer)


def _num(d: dict, key: str) -> float | None:
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _profile_case(c: dict, step: str, gpu: str, source: str) -> Case:
    over = {k: v for k, v in (c.get("overrides") or {}).items() if k != "seq_len"}
    cfg = GPTConfig.from_preset(c["preset"], **over)
    shape, structure = gpt_case_shape(cfg, c.get("seq_len"))
    named = str(c.get("attention", "default")).lower()
    attention = ATTENTION.get(named, DEFAULT_ATTENTION)
    optimizer = c.get("optimizer") if c.get("optimizer") in ("foreach", "fused") else "foreach"
    precision = "fp8" if c.get("precision") == "fp8" else "bf16"  # torchao float8, eager
    over_text = "".join(f" {k}={v}" for k, v in over.items())
    notes = []  # what the prediction prices only in part
    if named not in ATTENTION:
        notes.append(f"attention {named!r} has no kernel-table entry: priced as SDPA's default")
    return Case(
        f"{step} {c['preset']}{over_text} mb={c['micro_batch']} s={shape.seq_len}"
        + (f" {optimizer}" if c.get("optimizer") else "")
        + (" fp8" if precision == "fp8" else ""),
        source,
        gpu,
        shape,
        structure,
        Layout(micro_batch=int(c["micro_batch"])),
        eager_stack(attention, optimizer),
        precision,
        float(c.get("step_s") or 0.0),  # 0: the case did not run (``error``)
        _num(c, "peak_mem_bytes"),
        dict(c.get("gpu_s_by_category") or {}),
        dict(c.get("kernels_by_category") or {}),
        _num(c, "gpu_busy_s"),
        _num(c, "gpu_kernel_sum_s"),
        _num(c, "cpu_dispatch_s"),
        _num(c, "host_issue_s"),
        not_modelled=f"measured: {c['error']}" if c.get("error") else "",
        note=" ".join(notes),
        phases=dict(c.get("phases") or {}),
        largest_gaps=list(c.get("largest_gaps") or []),
        top_kernels=list(c.get("top_kernels") or []),
        # kernel records (a busy union beside the kernel sum) from before RECORDS_VERSION 2
        lambdas_dropped="gpu_kernel_sum_s" in c and int(c.get("kernel_records") or 1) < 2,
        complete_records=int(c.get("kernel_records") or 1) >= 2,
    )


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def profile_file_cases(path: Path) -> list[Case]:
    """The cases of a lone step_profile.json (a probe session's: the step's data alone)."""
    data = _json(path)
    gpu = gpu_profile_name(str(data.get("device", ""))) if isinstance(data, dict) else None
    if gpu is None:
        return []
    return [_profile_case(c, "probe", gpu, str(path)) for c in data.get("cases", [])]


def report_cases(path: Path) -> list[Case]:
    """The profile cases of one gpu-check report.json (none if it is not one)."""
    steps = _json(path)
    if not isinstance(steps, list):
        return []
    out = []
    for s in steps:
        if not isinstance(s, dict) or s.get("name") not in PROFILE_STEPS or s.get("status") != "ok":
            continue
        data = s.get("data") or {}
        gpu = gpu_profile_name(str(data.get("device", "")))
        if gpu is None:  # a CPU run or a GPU without a hardware.yaml profile
            continue
        out += [_profile_case(c, s["name"], gpu, str(path)) for c in data.get("cases", [])]
    return out


def run_case(run) -> Case | None:
    """The trainer run's training record as a Case (None: not a CUDA training run)."""
    try:
        records = contract.read(run.summary)
    except contract_records.ContractError:
        return None
    rec = next((r for r in records if isinstance(r, contract_records.TrainingMeasurement)), None)
    if rec is None or rec.where.device != "cuda":
        return None
    gpu = gpu_profile_name(rec.where.gpu_name or "")
    if gpu is None:
        return None
    cfg = GPTConfig(**rec.model)
    shape, structure = gpt_case_shape(cfg)
    compiled = bool((run.config.get("train") or {}).get("compile"))
    precision = RECIPES.get(rec.recipe) if rec.precision in ("bf16", "fp16") else None
    # train.compile compiles each block (train/parallelize.apply_compile): the final norm, the
    # head and the loss run eager, as torchtitan's do
    stack = (
        Stack(DEFAULT_ATTENTION, "fused", "eager", software="dtrain", optimizer="foreach")
        if compiled
        else eager_stack()
    )
    name = f"{run.path.parent.parent.name} {run.subproject}"
    layout = rec.layout
    if rec.strategy == "zero3" and layout.zero_stage == 0:  # FSDP on one GPU: the layout's
        layout = replace(layout, zero_stage=3)  # type keeps no ZeRO stage without data shards
    return Case(
        name + (" compiled" if compiled else ""),
        str(run.path),
        gpu,
        shape,
        structure,
        layout,
        stack,
        precision or "bf16",
        rec.step_time_s,
        float(rec.peak_mem_bytes),
        not_modelled=""
        if precision
        else f"recipe {rec.recipe} (no terms for it)"
        if rec.recipe not in RECIPES
        else f"{rec.precision} training (the model prices bf16 and FP8 steps)",
        note=(
            "FP8 without compile: its casts' bytes counted op by op (memory_bound.FP8_CAST_BYTES"
            " 'eager') at membound's eager cast rate, their launches per linear"
            " (eager.FP8_LAUNCHES_PER_LINEAR)"
            if precision == "fp8" and not compiled
            else ""
        ),
    )


def measured_cases(folder: str | Path) -> list[Case]:
    """Every CUDA measurement under ``folder``: the gpu-check reports' profile cases, then the
    trainer runs, each in path order."""
    root = Path(folder)
    if not root.is_dir():
        raise UserError(f"--measured {folder}: no such folder: give a results or measured/ folder")
    cases = [c for p in files_named(root, "report.json") for c in report_cases(p)]
    cases += [c for p in files_named(root, "step_profile.json") for c in profile_file_cases(p)]
    for run in complete_runs([root], warn=False):
        if not run.derived:
            case = run_case(run)
            if case is not None:
                cases.append(case)
    return cases
