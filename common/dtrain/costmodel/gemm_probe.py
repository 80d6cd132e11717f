"""The matmul probe that calibrates ``efficiency``: time the model's real GEMM shapes, fit the
achieved-fraction curve, and measure the fixed per-step overhead.

    python -m dtrain.costmodel.gemm_probe results/capstone/<time>     # dtrain capstone runs it

Reads the complete runs under the results folder (through ``dtrain.results.loader``), collects the
forward GEMMs of every model they trained (``efficiency.layer_gemms`` / ``head_gemm``, TP shards
included), times each on this device (CPU: fp32 on the runs' threads per rank, the peak being
the same 512³ probe the runs' MFU used; CUDA: bf16 against the datasheet peak), fits
f(W) = e_max·W/(W + W_half) (``efficiency.fit_curve``), and times one training step of each
model at its real size in one process (forward, backward, gradient clipping, AdamW, loss
read-back, as the trainer does). The fixed per-step overhead of a model is that step minus the
time the fitted curve gives its GEMMs: the cost of Python, autograd, elementwise kernels
(norms, activations, softmax, residuals: work that grows with d_model, so it is measured at the
real width, not on a shrunk model) and the optimizer. Writes a derived run
``<results>/gemm-probe/`` (``dtrain.results.derived``: config.yaml, env.json, summary.json with one
``dtrain.results.contract_records.GemmProbe``) that ``calibrate`` reads like any experiment's.

Load cancels (``dtrain.run.hostload``): on CPU every timing has the time its threads waited for a
CPU taken out (the kernel's per-thread run-queue delay), and is paired with the reference matmul
(the
512³ of the runs' MFU probe) timed right before and after it, so a slowdown that is not a wait (a
busy SMT sibling, cooled caches) cancels too: a GEMM's fraction is its rate over the reference's of
that moment, a step is scaled to the idle reference (the 90th percentile of all its timings: the
roofline here). Each run the probe read gets the load factor of its own timed window from the
capstone's timeline (``<results>/host-load.jsonl``, when there is one): the local check scales
that run's prediction by it, with its 10th-90th percentile spread. A fraction above 1 (faster than
the roofline) is a measurement error: the point is timed again and, if it stays above, left out of
the fit and listed in ``rejected``; a fitted e_max above 1 is capped at 1.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

from dtrain.core.errors import UserError
from dtrain.model import perf
from dtrain.model.args import GPTConfig
from dtrain.model.timing import queued_s
from dtrain.results import contract, contract_records
from dtrain.results.derived import claim_output, write_derived_run
from dtrain.results.loader import complete_runs
from dtrain.run import envinfo, hostload

from . import hardware
from .gpt_shape import moe_model_of
from .efficiency import Gemm, GemmCurve, fit_curve, gemm_time, head_gemm, layer_gemms
from .shapes import Layout, ModelShape

SUBPROJECT = "gemm-probe"


def targets(results: Path) -> tuple[list[dict], int, list[Path]]:
    """(models the runs trained: {"kind", "config": GPTConfig fields | block fields,
    "micro_batch", "tp"}, threads per rank, the runs they came from), from the runs' guide inputs
    (dtrain.results.contract)."""
    found, threads, sources = {}, [], []
    for run in complete_runs([results], warn=False):
        if run.derived:  # publishes no measurement of its own; its env.json is a source's copy
            continue
        if run.env.get("threads_per_rank"):
            threads.append(int(run.env["threads_per_rank"]))
        used = False
        for m in contract.read(run.summary):
            # an MoE run (``moe_run``) too: its model's step on one process (ep 1, every expert
            # local) gives its own fixed overhead (routing, the experts' permutation) to the
            # guide's MoE row
            if isinstance(
                m, (contract_records.TrainingMeasurement, contract_records.MoeMeasurement)
            ):
                ds = [
                    {
                        "kind": "gpt",
                        "config": dict(m.model),
                        "micro_batch": m.layout.micro_batch,
                        "tp": 1,
                    }
                ]
            elif isinstance(m, contract_records.TpMeasurement):
                ds = [
                    {
                        "kind": m.module,
                        "config": {
                            "d_model": m.d_model,
                            "n_head": m.n_head,
                            "n_kv_head": m.n_kv_head,
                            "seq_len": m.seq_len,
                            "mlp_ratio": m.mlp_ratio,
                        },
                        "micro_batch": m.micro_batch,
                        "tp": tp,
                    }
                    for tp in (1, m.tp)
                ]
            else:
                continue
            used = True
            found.update((repr(d), d) for d in ds)
        if used:
            sources.append(run.path)
    return (
        [found[k] for k in sorted(found)],
        (statistics.median(threads) if threads else 1),
        sources,
    )


def shape_of_target(t: dict) -> ModelShape:
    """The target as a dense shape; an MoE GPT as its dense proxy (every layer's MLP the width a
    token meets: ``moe_model.MoEModel.proxy``), whose GEMMs are its balanced FLOPs."""
    c = t["config"]
    if t["kind"] == "gpt" and c.get("moe"):
        return replace(moe_model_of(GPTConfig(**c)).proxy, name="")
    if t["kind"] == "gpt":
        return ModelShape(
            c["n_layer"],
            c["d_model"],
            c["n_head"],
            c["n_kv_head"] or c["n_head"],
            c["vocab_size"],
            c["seq_len"],
            float(c["mlp_ratio"]),
            False,
            c["tie_embeddings"],
        )
    ffn = float(c["mlp_ratio"]) if t["kind"] == "block" else 0.0
    return ModelShape(
        1, c["d_model"], c["n_head"], c["n_kv_head"] or c["n_head"], 1, c["seq_len"], ffn or 1e-9
    )


def gemms_of(t: dict) -> list[Gemm]:
    shape = shape_of_target(t)
    lay = Layout(tp=t["tp"], micro_batch=t["micro_batch"])
    out = [
        g
        for g in layer_gemms(shape, lay)
        if t["kind"] != "attention" or g.name not in ("fc1", "fc2")
    ]
    return out + ([head_gemm(shape, lay)] if t["kind"] == "gpt" else [])


REF_N = 512  # the reference matmul: the runs' own peak probe (perf.cpu_matmul_probe)
ABOVE_ROOFLINE = (
    1.05  # a fraction above this is a measurement error; up to it, timer noise (clipped to 1)
)
# the capstone's timeline of its processes' CPU and wait times (dtrain.run.hostload)
LOAD_FILE = "host-load.jsonl"


class Timer:
    """Seconds per call with the wait for a CPU taken out (CPU: ``hostload.Contention``; CUDA: wall
    time, other processes do not share the GPU's SMs). Keeps the wall and idle totals: their ratio
    is the load this probe ran under."""

    def __init__(self, device: torch.device):
        self.cpu = device.type == "cpu" and hostload.available()
        self.sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.wall = self.idle = 0.0

    def times(
        self, fn, reps: int = 5, min_total_s: float = 0.2, max_reps: int = 200
    ) -> list[float]:
        """At least ``reps`` calls after one warm-up, more (up to ``max_reps``) until
        ``min_total_s`` of wall time is spent: a millisecond step on shared cores needs many
        samples for a stable median."""
        fn()
        out: list[float] = []
        spent = 0.0
        while len(out) < reps or (spent < min_total_s and len(out) < max_reps):
            with hostload.Contention() as c:
                fn()
                if self.sync:
                    self.sync()
            out.append(c.idle if self.cpu else c.wall)
            spent += c.wall
            self.wall, self.idle = self.wall + c.wall, self.idle + out[-1]
        return out

    def load(self) -> float | None:
        return self.wall / self.idle if self.cpu and self.idle > 0 else None


class Reference:
    """The 512³ matmul of the runs' MFU probe, timed (waits taken out) right before and after every
    measurement: its best rates are the idle roofline, and its rate of the moment is the
    yardstick for slowdowns that are not waits (a busy SMT sibling, caches another process
    cooled)."""

    def __init__(self, timer: Timer, device: torch.device, dtype: torch.dtype):
        self.timer, self.rates = timer, []
        a = torch.randn(REF_N, REF_N, device=device, dtype=dtype)
        b = torch.randn(REF_N, REF_N, device=device, dtype=dtype)
        self.matmul = lambda: a @ b
        for _ in range(4):
            self.now()

    def now(self) -> float:
        """FLOP/s of a short block of reference matmuls (median), kept for `idle`."""
        rates = [2 * REF_N**3 / s for s in self.timer.times(self.matmul, reps=5, min_total_s=0.0)]
        self.rates += rates
        return statistics.median(rates)

    def around(self, measure):
        """(measure(), the reference rate around it: the mean of one block before and one after)."""
        before = self.now()
        value = measure()
        return value, (before + self.now()) / 2

    @property
    def idle(self) -> float:
        """The roofline: the 90th percentile of every rate timed (the fastest moments, robust to
        one outlier)."""
        return statistics.quantiles(self.rates, n=10, method="inclusive")[-1]


def gemm_seconds(g: Gemm, device: torch.device, dtype: torch.dtype, timer: Timer) -> float:
    a = torch.randn(g.count, g.m, g.k, device=device, dtype=dtype)
    b = torch.randn(g.count, g.k, g.n, device=device, dtype=dtype)
    if (
        device.type == "cuda"
    ):  # launched back to back, as in a training step (no launch gap per call)
        return queued_s(lambda: torch.bmm(a, b), device)
    return statistics.median(timer.times(lambda: torch.bmm(a, b)))


def step_s(t: dict, device: torch.device, timer: Timer) -> float:
    """One training step (forward, backward, clipping, AdamW, loss read-back) of the model at its
    real size."""
    from dtrain.model.gpt import GPT, Block

    c = dict(t["config"])
    torch.manual_seed(0)
    if t["kind"] == "gpt":
        cfg = GPTConfig(**c)
        model = GPT(cfg).to(device)
        x = torch.randint(0, cfg.vocab_size, (t["micro_batch"], cfg.seq_len), device=device)
        loss_fn = lambda: model(x, x)  # noqa: E731
    else:
        cfg = GPTConfig(
            vocab_size=2,
            seq_len=c["seq_len"],
            n_layer=1,
            n_head=c["n_head"],
            n_kv_head=c["n_kv_head"],
            d_model=c["d_model"],
            mlp_ratio=c["mlp_ratio"],
        )
        model = Block(cfg, "blocks.0", lambda n, i, o, b: torch.nn.Linear(i, o, bias=b)).to(device)
        x = torch.randn(t["micro_batch"], cfg.seq_len, cfg.d_model, device=device)
        loss_fn = lambda: model(x).square().mean()  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)

    # on CUDA the runs compute in bf16 (FSDP's MixedPrecisionPolicy), as the probe's GEMM points do
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )

    def step():  # what the trainer does per step: forward, backward, clip, AdamW, read the loss
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = loss_fn()
        loss.backward()
        if t["kind"] == "gpt":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss.item()

    return statistics.median(timer.times(step, reps=7, min_total_s=0.25))


def gemm_step_s(t: dict, curve: GemmCurve, peak: float, value_bytes: int) -> float:
    """Forward + backward (3x the forward FLOPs) of the target's GEMMs on the fitted curve."""
    if t["kind"] == "gpt":
        return 3 * _gpt_gemm_s(t, curve, peak, value_bytes)
    return 3 * sum(gemm_time(g, peak, 0.0, curve, value_bytes) for g in gemms_of(t))


def _gpt_gemm_s(t: dict, curve: GemmCurve, peak: float, value_bytes: int) -> float:
    shape = shape_of_target(t)
    lay = Layout(tp=t["tp"], micro_batch=t["micro_batch"])
    layer = sum(gemm_time(g, peak, 0.0, curve, value_bytes) for g in layer_gemms(shape, lay))
    return shape.n_layer * layer + gemm_time(head_gemm(shape, lay), peak, 0.0, curve, value_bytes)


def fit(points: list[dict]) -> GemmCurve | None:
    """The curve over the kept points; e_max above 1 (above the roofline) is capped at 1, with
    W_half refitted for it (weighted least squares of 1/f - 1 = W_half/W, as ``fit_curve``
    weighs)."""
    if len(points) < 2:
        return None
    pts = [
        (p["flops"], min(p["fraction"], 1.0)) for p in points
    ]  # W: the whole (batched) GEMM, as gemm_time
    curve = fit_curve(pts)
    if curve.e_max <= 1.0:
        return curve
    num = sum(f * f * (1 / w) * (1 / f - 1) for w, f in pts)
    den = sum(f * f * (1 / w) ** 2 for w, f in pts)
    return GemmCurve(1.0, max(num / den, 0.0) if den > 0 else 0.0)


def run_window(run) -> tuple[float, float]:
    """When a run timed its steps: the trainer's timed steps end when records.jsonl was last written
    and last as long as their step times add up to; other runs span env.json to records.jsonl."""
    from dtrain.results.loader import read_jsonl

    records = run.path / "records.jsonl"
    end = (
        records.stat().st_mtime if records.exists() else (run.path / "summary.json").stat().st_mtime
    )
    steps = (
        [r for r in read_jsonl(records) if r.get("kind") == "step" and "warmup_step" in r]
        if records.exists()
        else []
    )
    timed = sum(float(r["step_time_s"]) for r in steps if not r["warmup_step"])
    return (end - timed, end) if timed > 0 else ((run.path / "env.json").stat().st_mtime, end)


def run_loads(
    results: Path, runs: list, timeline: list[hostload.Sample]
) -> list[contract_records.RunLoad]:
    """Each run's load factor over its timed window, its own oversubscription divided out (busy
    threads = ranks x threads per rank, against env.json's cores)."""
    out = []
    for run in runs:
        busy = int(run.env.get("world_size") or 1) * int(run.env.get("threads_per_rank") or 1)
        cores = int(run.env.get("cpu_count") or 0)
        lf = hostload.load_factor(timeline, *run_window(run), busy, cores or None)
        if lf is not None:
            out.append(
                contract_records.RunLoad(
                    str(run.path.resolve().relative_to(results.resolve())),
                    busy,
                    lf.median,
                    lf.low,
                    lf.high,
                    lf.samples,
                )
            )
    return out


def probe(results: Path, device: str = "auto") -> Path:
    """Run the probe for the runs under ``results``; returns the run directory written."""
    results = Path(results)
    dev = torch.device(
        "cuda"
        if device == "auto" and torch.cuda.is_available()
        else ("cpu" if device == "auto" else device)
    )
    tg, threads, sources = targets(results)
    # its own folder, claimed before the timing (dtrain.results.derived): an earlier probe's is
    # never rewritten
    out = claim_output(results / SUBPROJECT, "gemm-probe", fix="remove it to probe again")
    timer, ref = Timer(dev), None
    if dev.type == "cpu":
        torch.set_num_threads(max(1, int(threads)))
        dtype, peak_source = torch.float32, perf.CPU_PROBE_SOURCE
        ref = Reference(timer, dev, dtype)
    else:
        dtype, (peak, peak_source) = torch.bfloat16, hardware.peak_flops(dev, "bf16")

    def fraction(
        g: Gemm,
    ) -> float:  # of the reference of the moment (CPU) or of the datasheet peak (CUDA)
        seconds, rate = (
            ref.around(lambda: gemm_seconds(g, dev, dtype, timer))
            if ref
            else (gemm_seconds(g, dev, dtype, timer), peak)
        )
        return g.flops * g.count / seconds / rate

    points, rejected, seen = [], [], set()
    # the curve from the dense runs' GEMMs only: an MoE run's are its dense proxy's, shapes its
    # kernels never run (its experts are many small GEMMs), which moved the curve of every dense row
    # (W_half 5.4e5 -> 3e5 FLOP, their predictions 8-10% lower); the MoE run keeps its own overhead
    for t in (t for t in tg if not t["config"].get("moe")):
        for g in gemms_of(t):
            key = (g.m, g.n, g.k, g.count)
            if key in seen:
                continue
            seen.add(key)
            for _ in range(
                3
            ):  # above the roofline is a measurement error: time it again, twice at most
                frac = fraction(g)
                if frac <= ABOVE_ROOFLINE:
                    break
            p = {
                "m": g.m,
                "n": g.n,
                "k": g.k,
                "count": g.count,
                "flops": g.flops * g.count,
                "fraction": frac,
            }
            (points if frac <= ABOVE_ROOFLINE else rejected).append(p)
    # each step as at the idle roofline: x (the reference of its moment / the idle reference)
    steps = [
        (t, *(ref.around(lambda: step_s(t, dev, timer)) if ref else (step_s(t, dev, timer), None)))
        for t in tg
        if t["tp"] == 1
    ]
    if ref:
        peak = ref.idle
    for p in points + rejected:
        p["seconds"] = p["flops"] / (p["fraction"] * peak)  # on the idle host
    curve = fit(points)
    vb = 4 if dtype == torch.float32 else 2
    overheads = []
    for t, step, rate in steps:
        step = step * rate / peak if rate else step
        gemm = gemm_step_s(t, curve, peak, vb) if curve else 0.0
        overheads.append(
            contract_records.StepOverhead(
                t["kind"],
                t["config"],
                t["micro_batch"],
                t["tp"],
                max(step - gemm, 0.0),
                step_s=step,
                gemm_s=gemm,
            )
        )
    runs = [
        r
        for r in complete_runs([results], warn=False)
        if r.path.resolve() in {s.resolve() for s in sources}
    ]
    gpu_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    record = contract_records.GemmProbe(
        dtype=str(dtype).replace("torch.", ""),
        peak_flops=peak,
        peak_flops_source=peak_source,
        points=[contract_records.GemmPoint(**p) for p in points],
        overheads=overheads,
        e_max=curve.e_max if curve else None,
        w_half=curve.w_half if curve else None,
        where=contract_records.where_of(dev, "none", gpu_name),
        rejected=[contract_records.GemmPoint(**p) for p in rejected],
        probe_load=timer.load(),
        loads=run_loads(results, runs, hostload.read(results / LOAD_FILE)),
    )
    env = envinfo.collect(
        backend="none",
        world_size=1,
        device=str(dev),
        launcher="local",
        threads_per_rank=int(threads),
    )
    return write_derived_run(
        out,
        SUBPROJECT,
        sources,
        {"device": dev.type, "threads": int(threads)},
        {"device": str(dev)},
        [record],
        env=env,
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m dtrain.costmodel.gemm_probe RESULTS_DIR")
    try:
        print(probe(Path(sys.argv[1])))
    except UserError as e:  # e.g. an earlier probe's folder: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
