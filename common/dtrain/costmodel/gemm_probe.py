"""The matmul probe that calibrates ``efficiency``: time the model's real GEMM shapes, fit the
achieved-fraction curve, and measure the fixed per-step overhead.

    python -m dtrain.costmodel.gemm_probe results/capstone/<time>     # dtrain capstone runs it

Reads the complete runs under the results folder (through ``dtrain.results``), collects the
forward GEMMs of every model they trained (``efficiency.layer_gemms`` / ``head_gemm``, TP shards
included), times each on this device (CPU: fp32 on the runs' threads per rank, the peak being
the same 512³ probe the runs' MFU used; CUDA: bf16 against the datasheet peak), fits
f(W) = e_max·W/(W + W_half) (``efficiency.fit_curve``), and times one training step of each
model at its real size in one process (forward, backward, gradient clipping, AdamW, loss
read-back, as the trainer does). The fixed per-step overhead of a model is that step minus the
time the fitted curve gives its GEMMs: the cost of Python, autograd, elementwise kernels
(norms, activations, softmax, residuals: work that grows with d_model, so it is measured at the
real width, not on a shrunk model) and the optimizer. Writes a derived run
``<results>/gemm-probe/`` (``dtrain.derived``: config.yaml, env.json, summary.json with one
``dtrain.contract.GemmProbe``) that ``calibrate`` reads like any experiment's.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

from dtrain import contract, envinfo, perf
from dtrain.derived import write_derived_run
from dtrain.results import complete_runs

from .efficiency import Gemm, GemmCurve, fit_curve, gemm_time, head_gemm, layer_gemms
from .memory import Layout, ModelShape

SUBPROJECT = "gemm-probe"


def targets(results: Path) -> tuple[list[dict], int, list[Path]]:
    """(models the runs trained: {"kind", "config": GPTConfig fields | block fields, "micro_batch", "tp"},
    threads per rank, the runs they came from), from the runs' guide inputs (dtrain.contract)."""
    found, threads, sources = {}, [], []
    for run in complete_runs([results], warn=False):
        if run.env.get("threads_per_rank"):
            threads.append(int(run.env["threads_per_rank"]))
        used = False
        for m in contract.read(run.summary):
            if isinstance(m, contract.TrainingMeasurement):
                ds = [{"kind": "gpt", "config": dict(m.model), "micro_batch": m.layout.micro_batch, "tp": 1}]
            elif isinstance(m, contract.TpMeasurement):
                ds = [{"kind": m.module, "config": {"d_model": m.d_model, "n_head": m.n_head, "n_kv_head": m.n_kv_head,
                                                    "seq_len": m.seq_len, "mlp_ratio": m.mlp_ratio},
                       "micro_batch": m.micro_batch, "tp": tp} for tp in (1, m.tp)]
            else:
                continue
            used = True
            found.update((repr(d), d) for d in ds)
        if used:
            sources.append(run.path)
    return [found[k] for k in sorted(found)], (statistics.median(threads) if threads else 1), sources


def shape_of_target(t: dict) -> ModelShape:
    c = t["config"]
    if t["kind"] == "gpt":
        return ModelShape(c["n_layer"], c["d_model"], c["n_head"], c["n_kv_head"] or c["n_head"], c["vocab_size"],
                          c["seq_len"], float(c["mlp_ratio"]), False, c["tie_embeddings"])
    ffn = float(c["mlp_ratio"]) if t["kind"] == "block" else 0.0
    return ModelShape(1, c["d_model"], c["n_head"], c["n_kv_head"] or c["n_head"], 1, c["seq_len"], ffn or 1e-9)


def gemms_of(t: dict) -> list[Gemm]:
    shape = shape_of_target(t)
    lay = Layout(1, t["tp"], 1, micro_batch=t["micro_batch"])
    out = [g for g in layer_gemms(shape, lay) if t["kind"] != "attention" or g.name not in ("fc1", "fc2")]
    return out + ([head_gemm(shape, lay)] if t["kind"] == "gpt" else [])


def _time(fn, reps: int = 5, sync=None, min_total_s: float = 0.25, max_reps: int = 200) -> float:
    """Median of at least ``reps`` timed calls after one warm-up, more (up to ``max_reps``) until
    ``min_total_s`` is spent: a millisecond step on shared cores needs many samples for a stable median."""
    fn()
    samples: list[float] = []
    while len(samples) < reps or (sum(samples) < min_total_s and len(samples) < max_reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_gemm(g: Gemm, device: torch.device, dtype: torch.dtype) -> float:
    a = torch.randn(g.count, g.m, g.k, device=device, dtype=dtype)
    b = torch.randn(g.count, g.k, g.n, device=device, dtype=dtype)
    if device.type == "cuda":  # launched back to back, as in a training step (no launch gap per call)
        from dtrain.gpucheck.kernels import _queued_s
        return _queued_s(lambda: torch.bmm(a, b), device)
    return _time(lambda: torch.bmm(a, b))


def step_s(t: dict, device: torch.device) -> float:
    """One training step (forward, backward, clipping, AdamW, loss read-back) of the model at its real size."""
    from dtrain.model import GPT, Block, GPTConfig

    c = dict(t["config"])
    torch.manual_seed(0)
    if t["kind"] == "gpt":
        cfg = GPTConfig(**c)
        model = GPT(cfg).to(device)
        x = torch.randint(0, cfg.vocab_size, (t["micro_batch"], cfg.seq_len), device=device)
        loss_fn = lambda: model(x, x)  # noqa: E731
    else:
        cfg = GPTConfig(vocab_size=2, seq_len=c["seq_len"], n_layer=1, n_head=c["n_head"], n_kv_head=c["n_kv_head"],
                        d_model=c["d_model"], mlp_ratio=c["mlp_ratio"])
        model = Block(cfg, "blocks.0", lambda n, i, o, b: torch.nn.Linear(i, o, bias=b)).to(device)
        x = torch.randn(t["micro_batch"], cfg.seq_len, cfg.d_model, device=device)
        loss_fn = lambda: model(x).square().mean()  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)

    # on CUDA the runs compute in bf16 (FSDP's MixedPrecisionPolicy), as the probe's GEMM points do
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def step():  # what the trainer does per step: forward, backward, clip, AdamW, read the loss
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = loss_fn()
        loss.backward()
        if t["kind"] == "gpt":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss.item()
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    return _time(step, reps=7, sync=sync)


def gemm_step_s(t: dict, curve: GemmCurve, peak: float, value_bytes: int) -> float:
    """Forward + backward (3x the forward FLOPs) of the target's GEMMs on the fitted curve."""
    if t["kind"] == "gpt":
        return 3 * _gpt_gemm_s(t, curve, peak, value_bytes)
    return 3 * sum(gemm_time(g, peak, 0.0, curve, value_bytes) for g in gemms_of(t))


def _gpt_gemm_s(t: dict, curve: GemmCurve, peak: float, value_bytes: int) -> float:
    shape = shape_of_target(t)
    lay = Layout(1, t["tp"], 1, micro_batch=t["micro_batch"])
    layer = sum(gemm_time(g, peak, 0.0, curve, value_bytes) for g in layer_gemms(shape, lay))
    return shape.n_layer * layer + gemm_time(head_gemm(shape, lay), peak, 0.0, curve, value_bytes)


def overhead_s(t: dict, device: torch.device, curve: GemmCurve | None, peak: float, value_bytes: int) -> dict:
    """The measured step, the curve's GEMM time and their difference (>= 0), the fixed overhead."""
    step = step_s(t, device)
    gemm = gemm_step_s(t, curve, peak, value_bytes) if curve else 0.0
    return {"step_s": step, "gemm_s": gemm, "overhead_s": max(step - gemm, 0.0)}


def probe(results: Path, device: str = "auto") -> Path:
    """Run the probe for the runs under ``results``; returns the run directory written."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    tg, threads, sources = targets(results)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, int(threads)))
        dtype, (peak, peak_source) = torch.float32, (perf.cpu_matmul_probe.__wrapped__(), perf.CPU_PROBE_SOURCE)
    else:
        dtype, (peak, peak_source) = torch.bfloat16, perf.peak_flops(dev, "bf16")
    points, seen = [], set()
    for t in tg:
        for g in gemms_of(t):
            key = (g.m, g.n, g.k, g.count)
            if key in seen:
                continue
            seen.add(key)
            s = time_gemm(g, dev, dtype)
            points.append({"m": g.m, "n": g.n, "k": g.k, "count": g.count, "flops": g.flops * g.count, "seconds": s,
                           "fraction": g.flops * g.count / s / peak})
    curve = fit_curve([(p["flops"], p["fraction"]) for p in points]) if len(points) >= 2 else None
    vb = 4 if dtype == torch.float32 else 2
    overheads = [contract.StepOverhead(t["kind"], t["config"], t["micro_batch"], t["tp"],
                                       **overhead_s(t, dev, curve, peak, vb)) for t in tg if t["tp"] == 1]
    record = contract.GemmProbe(dtype=str(dtype).replace("torch.", ""), peak_flops=peak, peak_flops_source=peak_source,
                                points=[contract.GemmPoint(**p) for p in points], overheads=overheads,
                                e_max=curve.e_max if curve else None, w_half=curve.w_half if curve else None,
                                where=contract.where_of(dev, "none", torch.cuda.get_device_name(dev) if dev.type == "cuda" else None))
    env = envinfo.collect(backend="none", world_size=1, device=str(dev), launcher="local",
                          threads_per_rank=int(threads))
    return write_derived_run(Path(results) / SUBPROJECT, SUBPROJECT, sources,
                             {"device": dev.type, "threads": int(threads)}, {"device": str(dev)}, [record], env=env)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m dtrain.costmodel.gemm_probe RESULTS_DIR")
    print(probe(Path(sys.argv[1])))
