"""Training steps of dtrain's GPT under the profiler: where one eager step's time goes on a GPU.

    python -m dtrain.gpucheck.stepprof step_profile | eager_sweep [--small]

One case is one step of what `dtrain.train` runs on one GPU without compile (bf16 autocast, SDPA
attention, AdamW foreach or fused, grad clipping; or torchao's tensorwise float8 on the blocks'
linears). Per case: the step's wall time (median of timed steps), the host time to issue it
(``cpu_dispatch_s``: the step is launch-bound when that is most of the wall time), each phase's
host and GPU time (``phases``, below), GPU time per kernel category with kernel launches, the
GPU's busy time and its idle gaps (``dtrain.gpucheck.timeline``), peak memory.

Phases: zero_grad, forward, backward, clip, optimizer. In every timed step the host's clock is
read and a CUDA event recorded on the stream at each boundary, so a phase's GPU time is the span
from the end of the previous phase's GPU work to the end of its own (its kernels and the GPU's
idle time between them); the step's GPU time starts at the first boundary, when the GPU is idle.
A phase whose GPU time is well above its kernels' is where the step idles.

``host_issue_s``: the host's time to issue the same step at ``ISSUE_TOKENS`` tokens (one sequence
of them), where the GPU keeps up and nothing holds the host back: the same kernels launched, a few
microseconds of GPU work each. A GPU-bound step's ``cpu_dispatch_s`` is not that: the host issues
slower as the GPU falls behind (gpu-check-20261127-164510: the 125M step's 1,169 launches took
33 ms at 2K tokens, 59 ms at 32K, its optimizer's phase 3.2 and 6.8 ms for the same kernels).
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch

from dtrain.gpucheck.kernels import _device, _name, sweep_main
from dtrain.gpucheck.timeline import (
    RECORDS_VERSION,
    account,
    gap_profile,
    kernel_records,
    top_kernels,
)

PHASES = ("zero_grad", "forward", "backward", "clip", "optimizer")
ISSUE_TOKENS = 128  # the host-issue probe's one sequence: every launch of the step, no GPU backlog


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class PhaseClock:
    """The host time and (on CUDA) the GPU time of each phase of one step: ``mark`` at each
    boundary reads ``time.perf_counter`` and records a CUDA event on the current stream."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"
        self.host: list[float] = []
        self.events: list = []

    def mark(self) -> None:
        self.host.append(time.perf_counter())
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)

    def seconds(self) -> dict[str, dict[str, float | None]]:
        """Per phase: host seconds and GPU seconds (None off CUDA); call after a sync."""
        out = {}
        for i, phase in enumerate(PHASES):
            gpu = self.events[i].elapsed_time(self.events[i + 1]) / 1e3 if self.cuda else None
            out[phase] = {"host_s": self.host[i + 1] - self.host[i], "gpu_s": gpu}
        return out


def median_phases(steps: list[dict]) -> dict[str, dict[str, float | None]]:
    """Each phase's median host and GPU seconds over the timed steps."""
    out = {}
    for phase in PHASES:
        gpu = [s[phase]["gpu_s"] for s in steps if s[phase]["gpu_s"] is not None]
        out[phase] = {
            "host_s": statistics.median(s[phase]["host_s"] for s in steps),
            "gpu_s": statistics.median(gpu) if gpu else None,
        }
    return out


def _float8(model, dev: torch.device) -> None:
    """torchao's tensorwise float8 (its default recipe) on the blocks' linears, as fp8-train's
    torchao recipe converts them (the output projection stays in bf16); emulated off CUDA."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(
        model,
        module_filter_fn=lambda _mod, fqn: fqn.startswith("blocks."),
        config=Float8LinearConfig(emulate=dev.type != "cuda"),
    )


def profile_case(
    preset: str,
    over: dict,
    mb: int,
    optimizer: str = "foreach",
    precision: str = "bf16",
    timed: int = 5,
) -> dict:
    """One eager training step of ``preset`` (+ ``over``, e.g. seq_len, n_layer) at micro-batch
    ``mb``, in bf16 or torchao float8 (``precision`` "fp8"): wall and host-issue time and each
    phase's host and GPU time (medians of ``timed`` steps), peak memory, and the GPU accounting
    and idle gaps of one more step under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from dtrain.model.gpt import GPT, GPTConfig

    dev = _device()
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset(preset, **over)
    model = GPT(cfg).to(dev)
    if precision == "fp8":
        _float8(model, dev)
    fused = optimizer == "fused" and dev.type == "cuda"
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, fused=fused or None, foreach=None if fused else True
    )
    x = torch.randint(0, cfg.vocab_size, (mb, cfg.seq_len), device=dev)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext()

    def issue(clock: PhaseClock | None = None, tokens=x):
        mark = clock.mark if clock is not None else (lambda: None)
        mark()
        opt.zero_grad(set_to_none=True)
        mark()
        with amp:
            loss = model(tokens, tokens)
        mark()
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        mark()
        opt.step()
        mark()
        return loss

    for _ in range(3):
        issue().item()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    walls, hosts, phases = [], [], []
    for _ in range(timed):
        _sync(dev)
        clock = PhaseClock(dev)
        t0 = time.perf_counter()
        loss = issue(clock)
        t1 = time.perf_counter()  # every op of the step issued; the GPU may still be working
        loss.item()
        _sync(dev)
        walls.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
        phases.append(clock.seconds())
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        issue().item()
    records = kernel_records(prof.profiler.kineto_results.events())
    host_issue = host_issue_s(issue, x[:1, : min(ISSUE_TOKENS, cfg.seq_len)], dev, timed)
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
        "precision": precision,
        "step_s": statistics.median(walls),
        "cpu_dispatch_s": statistics.median(hosts),
        "host_issue_s": host_issue,
        "issue_tokens": min(ISSUE_TOKENS, cfg.seq_len),
        "phases": median_phases(phases),
        "kernel_records": RECORDS_VERSION,
        "peak_mem_bytes": peak,
        **account(records),
        **gap_profile(records),
        **top_kernels(records),
    }
    return out


def host_issue_s(issue, tokens: torch.Tensor, dev: torch.device, timed: int) -> float:
    """The host's time to issue one step of ``issue`` on ``tokens`` (a short sequence: the GPU
    idles between kernels), the median of ``timed`` steps, each from an idle GPU (module
    docstring). Run after the measured steps: its updates change nothing they report."""
    for _ in range(2):
        issue(tokens=tokens).item()
    hosts = []
    for _ in range(timed):
        _sync(dev)
        t0 = time.perf_counter()
        loss = issue(tokens=tokens)
        hosts.append(time.perf_counter() - t0)
        loss.item()
    _sync(dev)
    return statistics.median(hosts)


def _run(cases: list[tuple]) -> dict:
    dev = _device()
    out = []
    for preset, over, mb, *opt in cases:
        try:
            out.append(profile_case(preset, over, mb, *opt))
        except (torch.OutOfMemoryError, ImportError) as e:  # a result, not a crash
            why = "out of memory" if isinstance(e, torch.OutOfMemoryError) else "not installed"
            out.append(
                {
                    "preset": preset,
                    "overrides": over,
                    "micro_batch": mb,
                    "error": f"{why}: {str(e)[:120]}",
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
# step where it fits; foreach against fused AdamW at the two smallest steps; torchao float8
# without compile at the shape of gpu-check's fp8_torchao_tensorwise_compile_false run (7B, 4
# layers, 2 x 4K tokens), whose casts the cost model counts op by op but no profile has measured.
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
    ("7b", {"n_layer": 4}, 2, "foreach", "fp8"),
]


def eager_sweep(small: bool = False) -> dict:
    if small:
        return _run(
            [
                ("tiny", {"seq_len": 64}, 2),
                ("tiny", {"seq_len": 128}, 1, "fused"),
                ("tiny", {"seq_len": 64}, 2, "foreach", "fp8"),
            ]
        )
    return _run(EAGER_CASES)


SWEEPS = {"step_profile": step_profile, "eager_sweep": eager_sweep}


def main(argv: list[str] | None = None) -> None:
    sweep_main("python -m dtrain.gpucheck.stepprof", SWEEPS, argv)


if __name__ == "__main__":
    main()
