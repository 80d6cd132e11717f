"""Overlap arithmetic on synthetic traces with hand-computed answers."""

import pytest

from fsdp_scaling.overlap import intersect, intervals_from_trace, merge, overlap_stats


def test_merge_and_intersect():
    assert merge([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7)]) == [(0, 4), (5, 6)]
    assert intersect([(0, 4), (5, 6)], [(1, 2), (3, 5.5)]) == [(1, 2), (3, 4), (5, 5.5)]


def test_overlap_stats_known_answer():
    # comm: [0,4) and [6,10) = 8 s; compute: [1,3) nested in [2,7) -> union [1,7) = 6 s
    # overlap: [1,4) + [6,7) = 4 s -> exposed 4 s, fraction 0.5; two steps halve the per-step times
    iv = [(0, 4, "comm"), (6, 10, "comm"), (1, 3, "compute"), (2, 7, "compute")]
    s = overlap_stats(iv, steps=2)
    assert s == {
        "comm_s": 4.0,
        "compute_s": 3.0,
        "overlapped_s": 2.0,
        "exposed_comm_s": 2.0,
        "overlap_fraction": 0.5,
    }
    assert overlap_stats([(0, 1, "compute")])["overlap_fraction"] is None
    with pytest.raises(ValueError, match="kinds"):
        overlap_stats([(0, 1, "idle")])


def test_intervals_from_cpu_and_gpu_traces():
    us = 1e6
    cpu = {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 2 * us, "tid": 1},
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "c10d::_allgather_base_",
                "ts": 2 * us,
                "dur": 1 * us,
                "tid": 1,
            },
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::mm",
                "ts": 0,
                "dur": 9 * us,
                "tid": 7,
            },  # other thread
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "gloo:all_gather",
                "ts": 1 * us,
                "dur": 3 * us,
                "tid": 9,
            },
            {"ph": "i", "name": "marker", "ts": 0},
        ]
    }
    iv = intervals_from_trace(cpu, main_tid=1)
    assert sorted(iv) == [(0.0, 2.0, "compute"), (1.0, 4.0, "comm")]
    assert overlap_stats(iv)["overlap_fraction"] == pytest.approx(1 / 3)
    gpu = {
        "traceEvents": [
            {
                "ph": "X",
                "cat": "kernel",
                "name": "ncclDevKernel_AllGather_RING_LL",
                "ts": 0,
                "dur": 4 * us,
            },
            {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm", "ts": 1 * us, "dur": 1 * us},
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::mm",
                "ts": 0,
                "dur": 10 * us,
                "tid": 1,
            },  # host side ignored
        ]
    }
    s = overlap_stats(intervals_from_trace(gpu, main_tid=1))
    assert (s["comm_s"], s["exposed_comm_s"], s["overlap_fraction"]) == (4.0, 3.0, 0.25)


def test_step_breakdown_puts_the_rings_sends_under_cp_comm():
    from fsdp_scaling.overlap import step_breakdown

    us = 1e6

    def ev(name, ts, dur, tid=1):
        return {
            "ph": "X",
            "cat": "cpu_op",
            "name": name,
            "ts": ts * us,
            "dur": dur * us,
            "tid": tid,
        }

    trace = {
        "traceEvents": [
            ev("aten::mm", 0, 4),
            ev("cp_comm:send_recv", 4, 1),
            ev("gloo:send", 4.5, 1.5),  # a send outlasting its range: still the ring's
            ev("aten::mm", 6, 2),
            ev("cp_comm:wait", 8, 1),
            ev(
                "gloo:all_reduce", 9, 1, tid=5
            ),  # the gradient all-reduce on gloo's thread: DP comm, exposed
        ]
    }
    b = step_breakdown(trace, 1)
    assert (b["compute_s"], b["cp_comm_s"], b["pp_p2p_s"], b["tp_comm_s"]) == (6.0, 3.0, 0.0, 0.0)
    assert (b["dp_comm_s"], b["dp_comm_exposed_s"], b["step_s"]) == (1.0, 1.0, 9.0)
