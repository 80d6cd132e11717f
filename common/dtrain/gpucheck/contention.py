"""The contention probe of `make gpu-check` (`python -m dtrain.gpucheck.probes contention`): what a
transfer running beside compute costs. A victim (bf16 GEMMs, memory-bound adds, a Llama block's
forward+backward) and a transfer of about half its time started together on two streams; the share
of the transfer the overlap did not hide, (makespan - victim alone) / transfer alone, what
``collectives.overlap_cost`` prices. The transfer is an SM copy kernel of C thread blocks (NCCL's
ring kernel holds one block per channel and copies through HBM) or the copy engines (device -> host
over PCIe, no SMs: about one NIC's rate); beside each, its SM share C/SMs and its HBM share (bytes
read + written per second over the HBM rate). Needs CUDA.
"""

from __future__ import annotations

import statistics

import torch

from dtrain.costmodel.hardware import get_profile
from dtrain.gpucheck.kernels import _device, _name
from dtrain.gpucheck.layer_probe import ShardBlock, gpu_profile


def _sm_copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):  # persistent: C blocks stride over the buffer
        start = tl.program_id(0) * BLOCK
        step = tl.num_programs(0) * BLOCK
        for off in range(start, n, step):
            idx = off + tl.arange(0, BLOCK)
            tl.store(dst + idx, tl.load(src + idx, mask=idx < n), mask=idx < n)

    return copy


def contention(small: bool = False) -> dict:
    """Each victim V (alone: T_v) and a transfer C sized to about half of it (alone: T_c) started
    together on two streams; the makespan M of both. The share of the transfer that overlap did not
    hide is
    cost = (M - T_v) / T_c: 0 when it hides wholly, 1 when the two ran one after the other. The
    victim's own stretch (its end - T_v) and the transfer's (its end - T_c) are kept apart beside
    it."""
    dev = _device()
    if dev.type != "cuda":
        return {"skipped": "contention needs a CUDA GPU (a side stream beside the compute)"}
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    hbm = (
        get_profile(gpu_profile(dev)).hbm_tbps * 1e12
    )  # the datasheet rate the HBM share is taken against
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16, generator=g)
    bm = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16, generator=g)
    big = [
        torch.randn(2**28, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3)
    ]  # 512 MiB each
    block = ShardBlock(4096, 32, 8, 14336, 1).to(dev, torch.bfloat16)  # Llama 3.1 8B's block, eager
    x = torch.randn(
        1, 4096, 4096, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True
    )
    pos = torch.arange(4096, device=dev, dtype=torch.float32)[:, None] / 10000 ** (
        torch.arange(0, 128, 2, device=dev, dtype=torch.float32) / 128
    )
    cos, sin = (f(pos).to(torch.bfloat16)[None, :, None, :] for f in (torch.cos, torch.sin))

    def block_step():
        block(x, cos, sin).sum().backward()
        x.grad = None
        block.zero_grad(set_to_none=True)

    victims = {
        "gemm_bf16_8192x10": lambda: [torch.mm(a, bm) for _ in range(10)],
        "add_512MiBx40": lambda: [torch.add(big[0], big[1], out=big[2]) for _ in range(40)],
        "llama3_8b_block_fwd_bwd": block_step,
    }
    src = torch.empty(2**27, device=dev, dtype=torch.bfloat16)  # 256 MiB each way: 4x the L2
    dst = torch.empty_like(src)
    host = torch.empty(2**26, dtype=torch.bfloat16, pin_memory=True)  # 128 MiB
    kern = _sm_copy_kernel()
    side = torch.cuda.Stream(dev)
    # (launch, HBM bytes read + written per launch, thread blocks held)
    aggressors = {
        f"sm_copy_{c}": (
            (lambda c=c: kern[(c,)](src, dst, src.numel(), BLOCK=4096)),
            4 * src.numel(),
            c,
        )
        for c in (8, 16, 32)
    }
    # PCIe through the copy engines (a NIC's rate, no SMs): HBM read once per byte
    aggressors["ce_d2h"] = (
        lambda: host.copy_(dst[: host.numel()], non_blocking=True),
        2 * host.numel(),
        0,
    )

    def ev():
        return torch.cuda.Event(enable_timing=True)

    def alone(fn, stream) -> float:
        with torch.cuda.stream(stream):
            fn()  # warm (and compile the Triton kernel)
            runs = []
            for _ in range(3):
                s, e = ev(), ev()
                s.record()
                fn()
                e.record()
                e.synchronize()
                runs.append(s.elapsed_time(e) / 1e3)
        return statistics.median(runs)

    rows = []
    for vname, victim in victims.items():
        t_v = alone(victim, torch.cuda.current_stream(dev))
        for aname, (launch, nbytes, blocks) in aggressors.items():
            one = alone(launch, side)
            n = max(1, round(0.5 * t_v / one))

            def batch(launch=launch, n=n):
                return [launch() for _ in range(n)]

            t_c = alone(batch, side)
            spans = []
            for _ in range(3):
                torch.cuda.synchronize()
                start, end_v, end_c = ev(), ev(), ev()
                start.record()
                side.wait_event(start)
                with torch.cuda.stream(side):
                    batch()
                    end_c.record()
                victim()
                end_v.record()
                torch.cuda.synchronize()
                spans.append((start.elapsed_time(end_v) / 1e3, start.elapsed_time(end_c) / 1e3))
            v_end = statistics.median(sp[0] for sp in spans)
            c_end = statistics.median(sp[1] for sp in spans)
            m = statistics.median(max(sp) for sp in spans)
            rows.append(
                {
                    "victim": vname,
                    "aggressor": aname,
                    "victim_s": t_v,
                    "transfer_s": t_c,
                    "makespan_s": m,
                    "victim_end_s": v_end,
                    "transfer_end_s": c_end,
                    "cost": (m - t_v) / t_c,
                    "victim_stretch": v_end / t_v - 1,
                    "transfer_stretch": c_end / t_c - 1,
                    "transfer_GBps_rw": n * nbytes / t_c / 1e9,
                    "sm_share": blocks / sms,
                    "hbm_share": n * nbytes / t_c / hbm,
                }
            )
    return {"device": _name(dev), "sms": sms, "hbm_Bps": hbm, "rows": rows}
