"""The markdown report of `make gpu-check`: each step's one-cell result (``summarize``), the
speedups and the grouped-GEMM table below the steps, the failed steps' output (``render``), and the
loss plot of its training steps (``plot_losses``); ``loss_falls`` says whether a training step
learned (the check fails one that did not). The steps and their numbers: ``check_step``."""

from __future__ import annotations

import json
from pathlib import Path

from dtrain.gpucheck.attention_dropout import dropout_slowdown
from dtrain.gpucheck.check_step import Step


# A training step of the check must learn: its last losses below its first by this share.
LOSS_DROP = 0.03


def loss_falls(data: dict) -> str | None:
    """Why a training step's loss did not fall (None when it fell): the mean of its last three
    losses against its first, which must be LOSS_DROP lower."""
    losses = data.get("losses") or []
    if len(losses) < 4:
        return None if not losses else f"only {len(losses)} losses recorded"
    last = sum(losses[-3:]) / 3
    if last < losses[0] * (1 - LOSS_DROP):
        return None
    return f"the loss did not fall: {losses[0]:.3f} -> {last:.3f} (mean of the last 3)"


def _f(v, spec: str, unit: str = "") -> str:
    return "-" if v is None else f"{format(v, spec)}{unit}"


def summarize(step: Step) -> str:
    """The one-cell result of a step."""
    d = step.data
    if not d:
        return step.note or "-"
    if step.name == "copy":
        return (
            f"{_f(d['GBps_read_plus_write'] / 1e3, '.2f')} TB/s (read + write, median of "
            f"{d['iters']})"
        )
    if step.name == "gemm_bf16":
        return (
            f"{_f(d['tflops'], '.0f')} TFLOP/s ({_f(d['share_of_peak'], '.0%')} of "
            f"{_f(d['peak_tflops'], '.0f')})"
        )
    if step.name == "gemm_fp8":
        if "skipped" in d:
            return d["skipped"]
        return (
            f"{_f(d['tflops_fast_accum'], '.0f')} TFLOP/s fast accum, {_f(d['tflops'], '.0f')} "
            f"without ({_f(d['share_of_peak'], '.0%')} of {_f(d['peak_tflops'], '.0f')}); max rel "
            f"err vs fp32 {d['max_rel_err_vs_fp32']:.1e}"
        )
    if step.name == "gemm_sweep":
        best = max(d["points"], key=lambda p: p["bf16_tflops"])
        out = f"bf16 up to {best['bf16_tflops']:.0f} TFLOP/s ({best['m']}x{best['n']}x{best['k']})"
        if "fp8_fast_tflops" in best:
            b8 = max(d["points"], key=lambda p: p["fp8_fast_tflops"])
            out += (
                f", FP8 fast accum up to {b8['fp8_fast_tflops']:.0f} "
                f"({b8['m']}x{b8['n']}x{b8['k']})"
            )
        return out + f"; {len(d['points'])} shapes in report.json"
    if step.name == "attention_sweep":
        ok = [
            p
            for p in d["points"]
            if "fwd_bwd_tflops" in p
            and p["causal"]
            and p["head_dim"] == 128
            and not p.get("dropout_p")
        ]
        best = {}
        for p in ok:
            if p["fwd_bwd_tflops"] > best.get(p["backend"], {}).get("fwd_bwd_tflops", 0):
                best[p["backend"]] = p
        out = (
            "; ".join(
                f"{b} causal hd128 fwd+bwd up to {p['fwd_bwd_tflops']:.0f} TFLOP/s (s {p['seq']})"
                for b, p in best.items()
            )
            or "-"
        )
        slow = dropout_slowdown(d["points"])
        return out + "".join(
            f"; {b} dropout 0.1 x{r:.2f} time (median over s {s[0]}-{s[-1]})"
            for b, (s, r) in slow.items()
        )
    if step.name == "membound":
        by = {
            (o["op"], o.get("d") or o.get("vocab") or o.get("params")): o["GBps"] for o in d["ops"]
        }
        return (
            ", ".join(
                f"{op} {v / 1e3:.2f} TB/s"
                for (op, size), v in by.items()
                if size in (4096, 128256, 1 << 27)
            )
            + f"; tiny kernel {d['tiny_kernel_s'] * 1e6:.1f} us"
        )
    if step.name in ("step_profile", "eager_sweep"):
        return "; ".join(profile_case_line(c) for c in d["cases"])
    if step.name == "grouped_gemm":
        pts = d["points"]
        return (
            f"grouped/dense TFLOP/s {pts[0]['grouped_tflops']:.0f}/{pts[0]['dense_tflops']:.0f} "
            f"at {pts[0]['tokens_per_expert']} tokens per expert, "
            f"{pts[-1]['grouped_tflops']:.0f}/{pts[-1]['dense_tflops']:.0f} at "
            f"{pts[-1]['tokens_per_expert']} (table below)"
        )
    if step.name == "layer_probe":
        return "; ".join(layer_line(c) for c in d["cases"])
    if step.name == "contention":
        if "skipped" in d:
            return d["skipped"]
        return "; ".join(
            f"{r['victim']} with {r['aggressor']} ({r['sm_share']:.0%} of SMs, "
            f"{r['hbm_share']:.0%} of HBM): {r['cost']:.2f} of the transfer not hidden"
            for r in d["rows"]
        )
    if step.kind == "probe":
        return (
            f"{d['dtype']} curve e_max {_f(d['e_max'], '.2f')}, W_half {_f(d['w_half'], '.3g')} "
            f"FLOP, {d['points']} GEMM shapes; overheads "
            + ", ".join(
                f"d{o[0]}: step {o[1] * 1e3:.1f} ms, fixed {o[2] * 1e3:.1f} ms"
                for o in d["overheads"]
            )
        )
    if step.kind == "fsdp":
        return (
            f"MFU {_f(d['mfu'], '.1%')}, {_f(d['tokens_per_s'], ',.0f')} tok/s, "
            f"{_f(d['tflops_per_rank'], '.0f')} TFLOP/s, step "
            f"{_f(d['step_time_s'] and d['step_time_s'] * 1e3, '.1f')} ms, peak mem "
            f"{_f(d['peak_mem_bytes'] and d['peak_mem_bytes'] / 2**30, '.1f')} GiB, loss "
            f"{_f(d.get('first_loss'), '.3f')} -> {_f(d.get('final_loss'), '.3f')}"
        )
    if step.kind == "fp8":
        return (
            f"{_f(d['tokens_per_s'], ',.0f')} tok/s, loss {_f(d['first_loss'], '.3f')} -> "
            f"{_f(d['final_loss'], '.3f')}, peak mem "
            f"{_f((d['peak_mem_bytes'] or 0) / 2**30, '.1f')} GiB"
        )
    if step.kind == "tp":
        return (
            f"single {_f(d['single_s'] and d['single_s'] * 1e3, '.2f')} ms, hand-rolled "
            f"{_f(d['handrolled_s'] and d['handrolled_s'] * 1e3, '.2f')} ms, DTensor "
            f"{_f(d['dtensor_s'] and d['dtensor_s'] * 1e3, '.2f')} ms per step"
        )
    if step.kind == "allreduce":
        return (
            f"{d['cases']} cases over {d['backend']}, {d['wrong_total']} wrong elements, "
            f"{d['skipped']} skipped"
        )
    if step.kind == "pytest":
        return ", ".join(f"{v} {k}" for k, v in d.items())
    return json.dumps(d)


def profile_case_line(c: dict) -> str:
    """One profiled training step: wall and host-issue time, GPU busy (union of kernel
    intervals; the kernels' sum where streams overlapped), kernels, peak memory, categories."""
    name = (
        f"{c['preset']}{'/' + str(c['n_layer']) + 'L' if c.get('overrides') else ''} "
        f"s{c.get('seq_len', '?')} mb {c.get('micro_batch')}"
        + (f" {c['optimizer']}" if "optimizer" in c else "")
        + (f" {c['precision']}" if c.get("precision", "bf16") != "bf16" else "")
    )
    if "error" in c:
        return f"{name}: {c['error']}"
    step = c["step_s"]
    out = f"{name}: step {step * 1e3:.1f} ms"
    if "cpu_dispatch_s" in c:
        out += f" (host issue {c['cpu_dispatch_s'] * 1e3:.1f} ms"
        if c.get("host_issue_s"):  # the same launches at a short sequence: the host's own time
            out += f"; {c['host_issue_s'] * 1e3:.1f} ms at {c.get('issue_tokens', '?')} tokens"
        out += ")"
    out += f", GPU busy {c['gpu_busy_s'] / step:.0%}"
    extra = c.get("gpu_kernel_sum_s", c["gpu_busy_s"]) - c["gpu_busy_s"]
    if extra > 0.01 * step:
        out += f" (kernels on {len(c.get('streams', {}))} streams overlap {extra / step:.0%})"
    if "kernels" in c:
        out += f", {c['kernels']:,} kernels"
    if c.get("peak_mem_bytes"):
        out += f", peak {c['peak_mem_bytes'] / 2**30:.1f} GiB"
    out += (
        " ("
        + ", ".join(
            f"{k} {v / step:.0%}"
            for k, v in sorted(c["gpu_s_by_category"].items(), key=lambda kv: -kv[1])
        )
        + ")"
    )
    if c.get("gaps"):  # the GPU's idle gaps (gpucheck/timeline.gap_profile): the longest
        g = c["largest_gaps"][0]
        out += (
            f"; GPU idle in {c['gaps']:,} gaps, {c['gap_s'] * 1e3:.1f} ms, the longest "
            f"{g['gap_s'] * 1e3:.2f} ms after {g['after'][:40]}"
        )
    phases = c.get("phases") or {}
    if any(p.get("gpu_s") is not None for p in phases.values()):
        out += "; phases host/GPU ms: " + " ".join(
            f"{k} {p['host_s'] * 1e3:.1f}/{p['gpu_s'] * 1e3:.1f}" for k, p in phases.items()
        )
    return out


def grouped_table(done: list[Step]) -> list[str]:
    """The MoE grouped-GEMM table: TFLOP/s by tokens per expert."""
    step = next((s for s in done if s.name == "grouped_gemm" and s.data), None)
    if step is None:
        return []
    d = step.data
    p0 = d["points"][0]
    fp8 = any("fp8_grouped_tflops" in p for p in d["points"])
    rows = [
        f"MoE expert GEMM, {p0['experts']} local experts, K {p0['k']} -> N {p0['n']}, "
        f"{d['dtype']} (TFLOP/s):",
        "",
        "| tokens per expert | grouped_mm | per-expert loop | dense, same FLOPs |"
        + (" FP8 grouped (row-wise) |" if fp8 else ""),
        "|---|---|---|---|" + ("---|" if fp8 else ""),
    ]
    for p in d["points"]:
        rows.append(
            f"| {p['tokens_per_expert']} | {p['grouped_tflops']:.0f} | {p['loop_tflops']:.0f} | "
            f"{p['dense_tflops']:.0f} |"
            + (f" {_f(p.get('fp8_grouped_tflops'), '.0f')} |" if fp8 else "")
        )
    errs = [p["fp8_error"] for p in d["points"] if "fp8_error" in p]
    if errs:
        rows.append(f"\nFP8 grouped GEMM did not run: {errs[0]}")
    return rows


def layer_line(c: dict) -> str:
    """One layer_probe case: measured forward+backward against the cost model's price of the same
    block."""
    if "error" in c:
        return f"{c['case']} {c['precision']}: {c['error']}"
    model = c.get("model") or {}
    out = f"{c['case']} {c['precision']} mb {c['micro_batch']}: {c['step_s'] * 1e3:.1f} ms"
    if "total" in model:
        out += (
            f", model {model['total'] * 1e3:.1f} ms (measured {c['step_s'] / model['total']:.2f}x)"
        )
    busy = c.get("gpu_s_by_category") or {}
    if busy:
        out += (
            " ("
            + ", ".join(
                f"{k} {v * 1e3:.1f}" for k, v in sorted(busy.items(), key=lambda kv: -kv[1])
            )
            + " ms)"
        )
    return out


def speedups(done: list[Step]) -> list[str]:
    by = {s.name: s.data.get("tokens_per_s") for s in done if s.kind == "fp8"}
    lines = []
    bf16, fp8 = by.get("fp8_scale_bf16"), by.get("fp8_scale_torchao_tensorwise")
    if bf16 and fp8:
        lines.append(
            f"- torchao tensorwise FP8 vs bf16 at d_model 4096, compiled, grad_accum 4: "
            f"**{fp8 / bf16:.2f}x** tokens/s ({fp8:,.0f} vs {bf16:,.0f}); loss curves of both in "
            "losses.png"
        )
    for c in ("false", "true"):
        bf16, fp8 = by.get(f"fp8_bf16_compile_{c}"), by.get(f"fp8_torchao_tensorwise_compile_{c}")
        if bf16 and fp8:
            lines.append(
                f"- torchao tensorwise FP8 vs bf16 at d_model 4096, compile={c}: "
                f"**{fp8 / bf16:.2f}x** tokens/s ({fp8:,.0f} vs {bf16:,.0f})"
            )
    return lines


def render(done: list[Step], run_dir: Path) -> str:
    env = next((s.data for s in done if s.name == "env"), {})
    head = (
        f"# gpu-check: {env.get('gpu_name', 'unknown GPU')} (profile "
        f"{env.get('profile')})\n\ntorch {env.get('torch')}, CUDA {env.get('cuda')}, NCCL "
        f"{env.get('nccl')}, Python {env.get('python')}; run directory `{run_dir}`; reproduce "
        "with `make gpu-check`.\n\n"
    )
    rows = ["| step | what | result | status | time |", "|---|---|---|---|---|"]
    for s in done:
        if s.name == "env":
            continue
        rows.append(f"| {s.name} | {s.what} | {summarize(s)} | {s.status} | {s.seconds:.0f} s |")
    out = head + "\n".join(rows) + "\n"
    extra = speedups(done)
    if extra:
        out += "\n" + "\n".join(extra) + "\n"
    table = grouped_table(done)
    if table:
        out += "\n" + "\n".join(table) + "\n"
    failed = [s for s in done if s.status not in ("ok", "skipped")]
    for s in failed:
        out += f"\n## {s.name}: {s.status}\n\n```\n{s.tail.strip()[-1500:]}\n```\n"
    return out


def plot_losses(done: list[Step], path: Path) -> Path | None:
    """Loss per step of every training step of the check that recorded losses, one panel per
    model (seaborn); None when none did."""
    rows = [
        {"step": i, "loss": v, "run": s.name}
        for s in done
        if s.data.get("losses")
        for i, v in enumerate(s.data["losses"])
    ]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd
    import seaborn as sns

    grid = sns.relplot(
        data=pd.DataFrame(rows), x="step", y="loss", hue="run", kind="line", height=4, aspect=1.6
    )
    grid.set(title="gpu-check training steps: loss per step")
    grid.savefig(path, dpi=110)
    return path
