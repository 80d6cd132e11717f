"""The fixed list of `make gpu-check`'s steps (``steps``): what each measures, its command and its
time limit, in the order they run by default (the runner is dtrain.gpucheck.__main__).

What one GPU can show (../shared/gpu/README.md): GEMM and copy ceilings, bf16 MFU single and FSDP2
with one rank, FP8 (torchao) against bf16 with and without torch.compile, the emulated FP8 recipe
under bf16, TP attention at tp=1, NCCL correctness with one rank, a published block at its TP shard
against the cost model (`layer_probe.layer_probe`), the cost of a transfer beside compute
(`contention.contention`). No bus bandwidth or scaling.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dtrain.gpucheck.check_step import Step

# Training steps that must learn: a learning rate for widths 768-4096 with a warm-up of a few
# steps (the trainer's default 3e-3 with 2 warm-up steps, tuned for the tiny CPU models, made
# the first checks' loss rise from 11.2 to 13.4); report.loss_falls fails a step whose loss
# did not fall.
LEARN = ["train.lr=3e-4", "train.min_lr=3e-5", "train.warmup_steps=6"]
QUIET_FP8 = [
    "fp8_debug.enabled=false",
    "health.enabled=false",
    "guard.enabled=false",
    "train.log_every=0",
]


def steps(runs: Path) -> list[Step]:
    """(name, what, command, time limit); {runs} is filled per step with its results folder."""
    m = [sys.executable, "-m", "dtrain.gpucheck.measure"]
    k = [sys.executable, "-m", "dtrain.gpucheck.kernels"]
    sp = [sys.executable, "-m", "dtrain.gpucheck.stepprof"]
    pr = [sys.executable, "-m", "dtrain.gpucheck.probes"]
    one_gpu = ["world_size=1", "device=cuda"]
    mfu = [
        "-m",
        "fsdp_scaling",
        *one_gpu,
        "model.preset=1b",
        "model.n_layer=8",
        "train.precision=bf16",
        "train.micro_batch=8",
        "train.steps=30",
        "train.timing_warmup=6",
        "profile.enabled=false",
        *LEARN,
    ]
    fp8_4096 = [
        "-m",
        "fp8_train",
        *one_gpu,
        "train.strategy=single",
        "model.preset=7b",
        "model.n_layer=4",
        "train.micro_batch=2",
        "train.steps=30",
        "train.timing_warmup=6",
        *LEARN,
        *QUIET_FP8,
    ]
    # FP8 where GEMMs dominate (issue 42): the same d_model 4096 model compiled, 4 micro-batches
    # of 2 x 2048 a step, so the fp32 AdamW step is a small share; 100 steps for both loss curves
    fp8_scale = [
        *(a for a in fp8_4096 if not a.startswith(("train.steps=", "train.timing_warmup="))),
        "train.grad_accum=4",
        "train.compile=true",
        "train.steps=100",
        "train.timing_warmup=10",
    ]
    # the eager trainer (FSDP2 zero3 on one rank, no compile) at the small-model and long-sequence
    # end, for the cost model's eager stack (issue 39): `dtrain backtest --measured` scores them
    eager = [
        "-m",
        "fsdp_scaling",
        *one_gpu,
        "train.strategy=zero3",
        "train.precision=bf16",
        "profile.enabled=false",
        "train.timing_warmup=6",
        *LEARN,
    ]
    eager_runs = [
        ("eager_125m_2k", "125m", [], 2048, 8, 30),
        ("eager_125m_8k", "125m", [], 8192, 2, 30),
        ("eager_125m_32k", "125m", [], 32768, 1, 20),
        ("eager_1b8l_8k", "1b", ["model.n_layer=8"], 8192, 2, 20),
        ("eager_1b8l_16k", "1b", ["model.n_layer=8"], 16384, 1, 20),
    ]
    py = [sys.executable]
    out = [
        Step("env", "the machine", [*m, "env"], 120),
        Step("copy", "device-to-device copy, 1 GiB, read + write bytes", [*m, "copy"], 120),
        Step("gemm_bf16", "bf16 GEMM 8192^3", [*m, "gemm_bf16"], 150),
        Step(
            "gemm_fp8",
            "FP8 GEMM 8192^3 (torch._scaled_mm, E4M3 x E4M3 -> bf16)",
            [*m, "gemm_fp8"],
            150,
        ),
        Step(
            "gemm_sweep",
            "bf16 / FP8 GEMM TFLOP/s over LLM training shapes",
            [*k, "gemm_sweep"],
            240,
        ),
        Step(
            "attention_sweep",
            "SDPA fwd / fwd+bwd TFLOP/s by backend, head dim, sequence",
            [*k, "attention_sweep"],
            240,
        ),
        Step(
            "membound",
            "memory-bound kernels (norms, SwiGLU, cross-entropy, AdamW) vs copy",
            [*k, "membound"],
            180,
        ),
        Step(
            "step_profile",
            "GPU time per kernel category of one GPT training step (profiler)",
            [*sp, "step_profile"],
            240,
        ),
        Step(
            "eager_sweep",
            "the eager step at 125M-1B and 2K-32K tokens and torchao FP8 at 7B/4 layers: host "
            "issue time (and at 128 tokens), each phase's host and GPU time, kernels and the "
            "costliest by name, GPU busy and idle gaps, peak memory; foreach vs fused AdamW",
            [*sp, "eager_sweep"],
            300,
        ),
        Step(
            "grouped_gemm",
            "MoE expert GEMM: torch._grouped_mm vs a per-expert loop vs dense, by tokens per "
            "expert (bf16; FP8 row-wise on Hopper)",
            [sys.executable, "-m", "dtrain.gpucheck.grouped"],
            180,
        ),
        Step(
            "layer_probe",
            "one published block at its TP shard (Llama 3.1 405B TP8, 8B), bf16 / FP8, compiled, "
            "full AC, against the cost model's price on this GPU",
            [*pr, "layer_probe"],
            420,
        ),
        Step(
            "contention",
            "GEMMs, adds and a Llama block beside an SM copy kernel of C blocks or PCIe copies: "
            "the share of the transfer the overlap did not hide",
            [*pr, "contention"],
            180,
        ),
        Step(
            "allreduce_nccl",
            "allreduce-bench over NCCL, one rank (correctness only)",
            [
                *py,
                "-m",
                "allreduce_bench",
                *one_gpu,
                "backend=nccl",
                "collectives=[all_reduce,all_gather,reduce_scatter,broadcast]",
                "max_bytes=64M",
                "dtypes=[float32,bfloat16]",
            ],
            240,
            kind="allreduce",
        ),
        Step(
            "mfu_single",
            "bf16 MFU, 1B-class GPT (d 2048, 8 layers), single",
            [*py, *mfu, "train.strategy=single"],
            300,
            kind="fsdp",
        ),
        Step(
            "mfu_zero3",
            "bf16 MFU, same model, FSDP2 zero3 on one rank",
            [*py, *mfu, "train.strategy=zero3"],
            300,
            kind="fsdp",
        ),
        Step(
            "emulated_bf16",
            "emulated FP8 (delayed) under bf16, 125M GPT",
            [
                *py,
                "-m",
                "fp8_train",
                *one_gpu,
                "train.strategy=single",
                "recipe=emulated_delayed",
                "train.precision=bf16",
                "model.preset=125m",
                "train.steps=30",
                "train.micro_batch=8",
                *QUIET_FP8,
            ],
            240,
            kind="fp8",
        ),
    ]
    for compiled in ("false", "true"):
        for recipe in ("bf16", "torchao_tensorwise"):
            out.append(
                Step(
                    f"fp8_{recipe}_compile_{compiled}",
                    f"d_model 4096 (7B shape, 4 layers): {recipe}, compile={compiled}",
                    [*py, *fp8_4096, f"recipe={recipe}", f"train.compile={compiled}"],
                    240,
                    kind="fp8",
                )
            )
    for recipe in ("bf16", "torchao_tensorwise"):
        out.append(
            Step(
                f"fp8_scale_{recipe}",
                f"d_model 4096 (7B shape, 4 layers), compiled, grad_accum 4, 100 steps: {recipe}",
                [*py, *fp8_scale, f"recipe={recipe}"],
                300,
                kind="fp8",
            )
        )
    for name, preset, over, seq, mb, n in eager_runs:
        out.append(
            Step(
                name,
                f"eager trainer, FSDP2 zero3 on one rank: {preset} {' '.join(over)} seq {seq}, "
                f"mb {mb}",
                [
                    *py,
                    *eager,
                    f"model.preset={preset}",
                    *over,
                    f"model.seq_len={seq}",
                    f"train.micro_batch={mb}",
                    f"train.steps={n}",
                ],
                240,
                kind="fsdp",
            )
        )
    out += [
        Step(
            "tp_attention",
            "TP attention block at tp=1 (bf16, b 4, s 2048, d 2048)",
            [
                *py,
                "-m",
                "tp_attention",
                *one_gpu,
                "train.tp=1",
                "train.precision=bf16",
                "train.sequence_parallel=false",
                "train.micro_batch=4",
                "model.seq_len=2048",
                "model.d_model=2048",
                "model.n_head=16",
            ],
            240,
            kind="tp",
        ),
        # the cost model's GPU compute calibration: the training runs above, their GEMMs timed on
        # this GPU
        Step(
            "gemm_probe",
            "gemm-probe over this check's training runs (the GPU calibration)",
            [*py, "-m", "dtrain.costmodel.gemm_probe", str(runs / "runs")],
            300,
            kind="probe",
        ),
        Step(
            "gpu_tests",
            "pytest -m gpu",
            [*py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts="],
            420,
            kind="pytest",
        ),
    ]
    return out
