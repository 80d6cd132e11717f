"""Training steps of dtrain's GPT under the profiler: where one eager step's time goes on a GPU.

    python -m dtrain.gpucheck.stepprof step_profile | eager_sweep [--small]

One case is one step of what `dtrain.train` runs on one GPU without compile (bf16 autocast, SDPA
attention, AdamW foreach or fused, grad clipping). Per case: the step's wall time (median of timed
steps), the host time to issue it (``cpu_dispatch_s``: the step is launch-bound when that is most
of the wall time), GPU time per kernel category with kernel launches, the GPU's busy time, peak
memory.

GPU accounting comes from the profiler's kernel records (``kernel_records``), not its per-name
averages: those also hold the GPU user annotations that ``record_function`` scopes leave on the GPU
timeline (``Optimizer.step#AdamW.step`` spans every optimizer kernel), which the first checks
summed with the kernels and so reported a GPU busy 120-128% of the step. ``gpu_busy_s`` is the
union of the kernel intervals (at most the step), ``gpu_kernel_sum_s`` their sum; the two differ
only where kernels of different streams overlap, which ``streams`` shows.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from dtrain.gpucheck.kernels import _category, _device, _name, sweep_main

GPU_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class KernelRecord:
    name: str
    start_ns: int
    end_ns: int
    stream: int


def kernel_records(events) -> list[KernelRecord]:
    """The GPU work among the profiler's kineto events (``prof.profiler.kineto_results.events()``):
    kernels, copies and memsets, without GPU user annotations; one record per distinct
    (name, start, end, stream), so a record reported twice counts once."""
    seen: dict[tuple, KernelRecord] = {}
    for e in events:
        if e.device_type().name != "CUDA" or not _gpu_work(e):
            continue
        r = KernelRecord(
            e.name(), e.start_ns(), e.start_ns() + e.duration_ns(), e.device_resource_id()
        )
        seen.setdefault((r.name, r.start_ns, r.end_ns, r.stream), r)
    return list(seen.values())


def _gpu_work(e) -> bool:
    """A GPU event that is work, not an annotation. torch 2.11's events have neither
    ``activity_type`` nor (before 2.5) ``is_user_annotation``: then an annotation is known by its
    name (``record_function`` scopes such as ``Optimizer.step#AdamW.step``, ``ProfilerStep#3``)."""
    annotation = getattr(e, "is_user_annotation", None)
    if annotation is not None and annotation():
        return False
    activity = getattr(e, "activity_type", None)
    if activity is not None:
        return str(activity()).lower().split(".")[-1] in GPU_ACTIVITIES
    name = e.name()
    return "#" not in name and not name.startswith(("ProfilerStep", "## "))


def union_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of [start, end) intervals."""
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def account(records: list[KernelRecord]) -> dict:
    """GPU seconds and launches per category, their sum, the busy union, and per-stream seconds."""
    by_cat: dict[str, float] = {}
    launches: dict[str, int] = {}
    streams: dict[str, float] = {}
    for r in records:
        cat = _category(r.name)
        by_cat[cat] = by_cat.get(cat, 0.0) + (r.end_ns - r.start_ns) / 1e9
        launches[cat] = launches.get(cat, 0) + 1
        streams[str(r.stream)] = streams.get(str(r.stream), 0.0) + (r.end_ns - r.start_ns) / 1e9
    return {
        "gpu_s_by_category": by_cat,
        "kernels_by_category": launches,
        "kernels": sum(launches.values()),
        "gpu_kernel_sum_s": sum(by_cat.values()),
        "gpu_busy_s": union_ns([(r.start_ns, r.end_ns) for r in records]) / 1e9,
        "streams": streams,
    }


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def profile_case(
    preset: str, over: dict, mb: int, optimizer: str = "foreach", timed: int = 5
) -> dict:
    """One eager training step of ``preset`` (+ ``over``, e.g. seq_len, n_layer) at micro-batch
    ``mb``: wall and host-issue time (medians of ``timed`` steps), peak memory, and the GPU
    accounting of one more step under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from dtrain.model.gpt import GPT, GPTConfig

    dev = _device()
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset(preset, **over)
    model = GPT(cfg).to(dev)
    fused = optimizer == "fused" and dev.type == "cuda"
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, fused=fused or None, foreach=None if fused else True
    )
    x = torch.randint(0, cfg.vocab_size, (mb, cfg.seq_len), device=dev)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext()

    def issue():
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = model(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    for _ in range(3):
        issue().item()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    walls, hosts = [], []
    for _ in range(timed):
        _sync(dev)
        t0 = time.perf_counter()
        loss = issue()
        t1 = time.perf_counter()  # every op of the step issued; the GPU may still be working
        loss.item()
        _sync(dev)
        walls.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        issue().item()
    gpu = account(kernel_records(prof.profiler.kineto_results.events()))
    out = {
        "preset": preset,
        "overrides": {k: v for k, v in over.items() if k != "seq_len"},
        "micro_batch": mb,
        "seq_len": cfg.seq_len,
        "d_model": cfg.d_model,
        "n_layer": cfg.n_layer,
        "vocab_size": cfg.vocab_size,
        "params": sum(p.numel() for p in model.parameters()),
        "attention": "sdpa",
        "optimizer": "fused" if fused else "foreach",
        "step_s": statistics.median(walls),
        "cpu_dispatch_s": statistics.median(hosts),
        "peak_mem_bytes": peak,
        **gpu,
    }
    return out


def _run(cases: list[tuple]) -> dict:
    dev = _device()
    out = []
    for preset, over, mb, *opt in cases:
        try:
            out.append(profile_case(preset, over, mb, *opt))
        except torch.OutOfMemoryError as e:  # a case that does not fit is a result, not a crash
            out.append(
                {
                    "preset": preset,
                    "overrides": over,
                    "micro_batch": mb,
                    "error": f"out of memory: {str(e)[:120]}",
                }
            )
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"device": _name(dev), "cases": out}


def step_profile(small: bool = False) -> dict:
    """The models `make gpu-check` trains, at their own sequence length."""
    if small:
        return _run([("tiny", {}, 2)])
    return _run(
        [
            ("125m", {}, 8),
            ("1b", {"n_layer": 8}, 8),
            ("7b", {"n_layer": 4}, 2),
            ("7b", {"n_layer": 4}, 1),
        ]
    )


# The eager stack where it is launch- or memory-bound: small models, long sequences, ~16K tokens a
# step where it fits; foreach against fused AdamW at the two smallest steps.
EAGER_CASES = [
    ("125m", {"seq_len": 2048}, 8),
    ("125m", {"seq_len": 2048}, 8, "fused"),
    ("125m", {"seq_len": 2048}, 1),
    ("125m", {"seq_len": 8192}, 2),
    ("125m", {"seq_len": 16384}, 1),
    ("125m", {"seq_len": 32768}, 1),
    ("350m", {"seq_len": 2048}, 8),
    ("350m", {"seq_len": 8192}, 2),
    ("1b", {"n_layer": 8, "seq_len": 2048}, 8),
    ("1b", {"n_layer": 8, "seq_len": 2048}, 8, "fused"),
    ("1b", {"n_layer": 8, "seq_len": 8192}, 2),
    ("1b", {"n_layer": 8, "seq_len": 16384}, 1),
    ("1b", {"n_layer": 8, "seq_len": 32768}, 1),
]


def eager_sweep(small: bool = False) -> dict:
    if small:
        return _run([("tiny", {"seq_len": 64}, 2), ("tiny", {"seq_len": 128}, 1, "fused")])
    return _run(EAGER_CASES)


SWEEPS = {"step_profile": step_profile, "eager_sweep": eager_sweep}


def main(argv: list[str] | None = None) -> None:
    sweep_main("python -m dtrain.gpucheck.stepprof", SWEEPS, argv)


if __name__ == "__main__":
    main()
