"""The GEMM probe's timing on this device, with the host's load taken out: ``Timer`` (seconds
per call less the wait for a CPU), ``Reference`` (the runs' 512³ MFU matmul timed around every
measurement: the idle roofline and the yardstick of the moment), and the two things timed, one
batched GEMM (``gemm_seconds``) and one training step of a model at its real size (``step_s``)."""

from __future__ import annotations

import contextlib
import statistics

import torch

from dtrain.model.args import GPTConfig
from dtrain.model.timing import queued_s
from dtrain.run import hostload

from .efficiency import Gemm

REF_N = 512  # the reference matmul: the runs' own peak probe (perf.cpu_matmul_probe)


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
