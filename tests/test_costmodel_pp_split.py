"""The "balanced" pipeline split (``Layout.pp_split``: the embedding and the loss take one
layer's slot each, Megatron's --account-for-embedding-in-pipeline-split /
--account-for-loss-in-pipeline-split, Llama 3 §3.3.2) and the first stage's activations counted
chunk by chunk: layer counts by hand, the interleaved warm-up against a simulation of Megatron's
schedule, the Llama 3 405B rows' memory by hand, the CLI's field and its errors."""

import json

import pytest

from dtrain.cli.main import main
from dtrain.costmodel import Layout, ModelShape, bubble_fraction, params_per_gpu
from dtrain.costmodel.published_runs import load_rows, row_setup
from dtrain.costmodel.activations import (
    activation_bytes,
    held_layer_microbatches,
    in_flight,
    layer_activation_bytes,
)
from dtrain.costmodel.overrides import train_overrides
from dtrain.costmodel.stack_memory import memory_for
from dtrain.costmodel.shapes import (
    end_stage_layers,
    last_stage_layers,
    pipeline_slots,
    stage_layers,
)

LLAMA3_405B = ModelShape(126, 16384, 128, 8, 128256, 8192, 53248 / 16384, True)
GiB = 2**30


def test_layer_counts_by_hand():
    bal = Layout(
        dp_shard=64,
        tp=8,
        pp=16,
        zero_stage=3,
        grad_accum=32,
        sequence_parallel=True,
        pp_virtual=8,
        pp_split="balanced",
    )
    even = Layout(
        dp_shard=64, tp=8, pp=16, zero_stage=3, grad_accum=32, sequence_parallel=True, pp_virtual=8
    )
    # 126 + 2 slots on 16 stages: 8 each; the ends give one to the embedding / the loss; 8 chunks of
    # 1 slot each
    assert (pipeline_slots(LLAMA3_405B, bal), stage_layers(LLAMA3_405B, 16, "balanced")) == (128, 8)
    assert end_stage_layers(LLAMA3_405B, bal) == (7, 0) and last_stage_layers(LLAMA3_405B, bal) == 7
    # the default: ceil(126/16) = 8 per stage, the last keeps 126 - 15·8 = 6, the chunk 8/8
    assert (
        end_stage_layers(LLAMA3_405B, even) == (8, 1.0)
        and last_stage_layers(LLAMA3_405B, even) == 6
    )
    # two stages: each end gives a slot, 63 + 63
    two = Layout(pp=2, grad_accum=4, pp_split="balanced")
    assert (
        stage_layers(LLAMA3_405B, 2, "balanced") == 63 and last_stage_layers(LLAMA3_405B, two) == 63
    )
    # the bubble over slots: 15 fill slots of one layer against 32 micro-batches of 8 layers
    assert bubble_fraction(16, 32, 8, pipeline_slots(LLAMA3_405B, bal)) == pytest.approx(
        15 / (8 * 32)
    )


def megatron_first_rank_peak(pp: int, v: int, m: int, chunk_layers: list[float]) -> float:
    """Reference: Megatron's interleaved schedule on pipeline rank 0 runs (v−1)·pp + 2(pp−1)
    warm-up forwards (at most m·v) and one more before its first backward; forward k is of chunk
    (k // pp) % v. The layer activations it then holds, one per layer per micro-batch in flight."""
    held = min((v - 1) * pp + 2 * (pp - 1) + 1, m * v)
    return sum(chunk_layers[(k // pp) % v] for k in range(held))


@pytest.mark.parametrize(
    "pp, v, m, split",
    [
        (16, 8, 32, "balanced"),
        (16, 8, 16, "balanced"),
        (16, 2, 32, "layers"),
        (4, 2, 8, "layers"),
        (4, 2, 12, "balanced"),
        (8, 4, 8, "balanced"),
        (8, 2, 64, "layers"),
    ],
)
def test_first_stage_activations_match_megatrons_warm_up(pp, v, m, split):
    shape = ModelShape(pp * v * 2 - (2 if split == "balanced" else 0), 1024, 16, 16, 32000, 2048)
    lay = Layout(pp=pp, grad_accum=m, pp_virtual=v, pp_split=split)
    chunk = (pp * v * 2) // (pp * v)  # 2 slots a chunk
    first_rank = [chunk - 1 if (c == 0 and split == "balanced") else chunk for c in range(v)]
    print(f"pp={pp} v={v} m={m} split={split}: chunks of rank 0 {first_rank}")
    assert held_layer_microbatches(shape, lay) == pytest.approx(
        megatron_first_rank_peak(pp, v, m, first_rank)
    )
    if (
        split == "layers"
    ):  # equal chunks: the count is in_flight x the stage's layers (Korthikanti §4.2.3)
        assert held_layer_microbatches(shape, lay) == pytest.approx(
            in_flight(lay) * sum(first_rank)
        )


def test_gpipe_holds_every_micro_batch_through_the_whole_stage():
    shape = ModelShape(30, 1024, 16, 16, 32000, 2048)  # 32 slots on 4 stages: 7 layers on the first
    lay = Layout(pp=4, grad_accum=8, pp_schedule="gpipe", pp_virtual=2, pp_split="balanced")
    assert held_layer_microbatches(shape, lay) == 8 * 7


@pytest.mark.parametrize("name", [r["name"] for r in load_rows() if r["group"] == "llama3"])
def test_llama3_rows_memory_by_hand(name):
    s = row_setup(next(r for r in load_rows() if r["name"] == name))
    lay = s.layout
    assert (lay.pp_split, lay.virtual_stages) == ("balanced", 8)
    per_layer = layer_activation_bytes(s.shape, lay)
    # SP: s/cp·b·h/t · (8 replicated + 4 + 4r + 2·3·F/h) with r = 8/128, F/h = 3.25, no dropout
    assert per_layer == pytest.approx(
        (s.shape.seq_len // lay.cp) * 16384 / 8 * (8 + 4 + 4 / 16 + 6 * 3.25)
    )
    held = (
        16 * 7
    )  # 16 micro-batches through the first stage's 7 layers; its first chunk is the embedding alone
    assert held_layer_microbatches(s.shape, lay) == held
    mem = memory_for(s.shape, lay, s.stack)
    psi = params_per_gpu(s.shape, 8, 16, "balanced")
    assert psi == pytest.approx(
        8 * (LLAMA3_405B.params_per_layer() - 2 * 16384 * 8 * 128) / 8 + 8 * 2 * 16384 * 128
    )
    assert mem.buffers == pytest.approx(
        6 * psi
    )  # ZeRO-3 under PP: bf16 weights gathered + fp32 gradients
    assert mem.activations >= held * per_layer
    assert mem.total < 80 * GiB, f"{name}: {mem.total / GiB:.1f} GiB"
    # the default split with 2 chunks a stage (the row's assumption before the paper's §3.3.2 was
    # read) does not fit
    even = Layout(
        dp_shard=lay.dp,
        cp=lay.cp,
        tp=lay.tp,
        pp=lay.pp,
        zero_stage=3,
        recompute="none",
        micro_batch=1,
        grad_accum=lay.grad_accum,
        sequence_parallel=True,
        pp_virtual=2,
    )
    assert memory_for(s.shape, even, s.stack).total > 80 * GiB


def test_the_default_split_is_unchanged():
    lay = Layout(
        dp_shard=8,
        tp=8,
        pp=8,
        zero_stage=1,
        recompute="full",
        micro_batch=1,
        grad_accum=16,
        sequence_parallel=True,
        pp_virtual=2,
    )
    shape = ModelShape(96, 12288, 96, 96, 50257, 2048, dropout=True)
    first = activation_bytes(shape, lay)
    assert held_layer_microbatches(shape, lay) == pytest.approx(in_flight(lay) * 12)
    assert first > 0 and params_per_gpu(shape, 8, 8) == params_per_gpu(shape, 8, 8, "layers")


def plan(capsys, layout: str):
    code = main(
        [
            "plan",
            "--params",
            "405e9",
            "--gpus",
            "8192",
            "--gpu",
            "h100-sxm",
            "--global-batch",
            "2048",
            "--seq",
            "8192",
            "--json",
            "--top",
            "0",
            "--layout",
            layout,
        ]
    )
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_scores_the_balanced_split(capsys):
    code, out, _ = plan(
        capsys, "dp=64 tp=8 pp=16 v=8 split=balanced zero=3 recompute=none mb=1 sp=on"
    )
    ans = json.loads(out)["layout"]
    assert code in (0, 1) and ans["pp_split"] == "balanced" and "split=balanced" in ans["describe"]


@pytest.mark.parametrize(
    "layout, message",
    [
        (
            "dp=8192 pp=1 split=balanced",
            "split=balanced splits layers over pipeline stages but pp=1",
        ),
        ("tp=8 pp=16 split=even", "split='even' must be one of layers, balanced"),
    ],
)
def test_cli_split_errors(capsys, layout, message):
    code, _, err = plan(capsys, layout)
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1


def test_overrides_say_the_trainer_splits_its_own_way():
    lay = Layout(dp_shard=2, pp=4, zero_stage=3, grad_accum=8, pp_split="balanced")
    _, notes = train_overrides(lay, ModelShape(14, 256, 4, 4, 50304, 256), 16)
    assert any("split=balanced runs as the trainer's own split" in n for n in notes)
