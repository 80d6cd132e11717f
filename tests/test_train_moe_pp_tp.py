"""An MoE model under pipeline parallelism and tensor parallelism of the attention (expert TP 1)
equals world_size=1 (fp32, gloo, dropless: losses and grad norms within 1e-6 relative):

    pp=2            the stages' MoE layers, the Switch auxiliary loss gathered from every stage
                    (the reported loss and its gradient), the MoE metrics from every stage
    tp=2            each tp rank routes its share of the tokens (with and without sequence
                    parallelism, hand-rolled and DTensor TP), ep = 1 and ep = 2 folded from tp
    4 ranks (slow)  pp=2 x ep=2, tp=2 x ep=2 with efsdp=2, tp=2 x ep=4, tp=2 x dp=2,
                    pp=2 x tp=2, pp=2 x tp=2 x ep=2

and pp2 and tp2 x ep2 checkpoints resume on one rank; an ep rank whose experts receive no rows
still runs the dispatch's backward (the pipeline's shape inference, on uniform inputs, routes
every token to one rank's experts: it hung there before).

The trainings run inside one launch per world size (test_train_ep's helpers): the tiny GPT with 2
layers, 4 experts, top-2, global batch 4 = micro-batches of 1."""

from __future__ import annotations

import pytest
import torch

from conftest import local_cpu_run
from dtrain.core.errors import UserError
from dtrain.model.gpt import GPTConfig
from dtrain.model.moe_args import MoEArgs
from dtrain.parallel.feasibility import check_moe
from dtrain.run.launch import launch
from test_train_ep import REL, max_rel, run_specs

AUX = {"aux_loss_coef": 0.01}


def _compare(runs: dict, refs: dict) -> None:
    for name, res in runs.items():
        ref = refs["aux" if "aux" in name else "single"]
        for key in ("losses", "grad_norms"):
            err = max_rel(res[key], ref[key])
            print(f"{name} {key} max rel diff {err:.1e}")
            assert err <= REL, (name, key, res[key], ref[key])


def _references(tmp_path) -> dict:
    return run_specs(
        tmp_path,
        1,
        {"single": {"strategy": "single"}, "aux": {"strategy": "single", "moe": AUX}},
    )


@pytest.mark.slow  # ~10 s; fast: MoE under EP (test_train_ep), PP and TP (test_train_layouts)
def test_moe_pp2_and_tp2_match_one_rank(tmp_path):
    refs = _references(tmp_path)
    assert refs["aux"]["losses"][0] > refs["single"]["losses"][0]  # the aux loss is in it
    assert refs["aux"]["grad_norms"][0] != refs["single"]["grad_norms"][0]  # and its gradient
    two = run_specs(
        tmp_path,
        2,
        {
            "pp2": {"pp": 2},
            "pp2_aux": {"pp": 2, "moe": AUX},
            "pp2_gpipe_aux": {"pp": 2, "pp_schedule": "gpipe", "moe": AUX},
            "pp2_block_ac_aux": {"pp": 2, "activation_checkpointing": "block", "moe": AUX},
            "tp2": {"tp": 2},
            "tp2_sp": {"tp": 2, "sequence_parallel": True},
            "tp2_dtensor": {"tp": 2, "tp_impl": "dtensor"},
            "tp2_dtensor_sp": {"tp": 2, "tp_impl": "dtensor", "sequence_parallel": True},
            "tp2_block_ac": {"tp": 2, "activation_checkpointing": "block"},
            "tp2_ep2": {"tp": 2, "ep": 2},  # ep folded from the tp ranks
            "tp2_sp_ep2": {"tp": 2, "ep": 2, "sequence_parallel": True},
        },
    )
    _compare(two, refs)
    assert two["tp2_ep2"]["result"]["ep"] == 2
    # every stage's layers and every tp rank's tokens counted once: at ep = 1 the overload factor
    # (the busiest expert's) is the one-rank run's, step by step
    for name in ("pp2", "pp2_gpipe_aux", "tp2", "tp2_sp", "tp2_dtensor_sp"):
        ref = refs["aux" if "aux" in name else "single"]
        assert two[name]["overload"] == ref["overload"], name
    assert all(o >= 1.0 for o in two["tp2_ep2"]["overload"])


@pytest.mark.slow  # 4 ranks on 2 cores: ~60 s
def test_four_ranks_moe_pp_and_tp_with_ep_match_one_rank(tmp_path):
    refs = _references(tmp_path)
    four = run_specs(
        tmp_path,
        4,
        {
            "pp2_ep2": {"pp": 2, "ep": 2},
            "pp2_ep2_aux": {"pp": 2, "ep": 2, "moe": AUX},
            "tp2_ep2_efsdp2": {"tp": 2, "ep": 2},
            "tp2_ep4": {"tp": 2, "ep": 4},
            "tp2_dp2": {"tp": 2},
            "pp2_tp2": {"pp": 2, "tp": 2},
            "pp2_tp2_sp_ep2": {"pp": 2, "tp": 2, "ep": 2, "sequence_parallel": True},
        },
    )
    _compare(four, refs)


def test_moe_tp_needs_a_sequence_the_tp_ranks_share_evenly():
    """Each tp rank routes seq_len / (cp x tp) tokens of a sequence: one line otherwise."""
    model = GPTConfig.from_preset("tiny", seq_len=40, moe=MoEArgs(experts=4, top_k=2))
    check_moe(model, ep=1, etp=1, tp=4, pp=2, strategy="zero3", cp=2)  # 40 / 2 / 4 = 5
    with pytest.raises(UserError) as e:
        check_moe(model, ep=1, etp=1, tp=4, pp=1, strategy="zero3", cp=4)
    assert str(e.value) == (
        "train.tp=4 with an MoE model: each tp rank routes its share of a rank's 10 tokens "
        "(model.seq_len / train.cp), which tp does not divide: pick seq_len a multiple of 16"
    )


@pytest.mark.slow  # the fast path resumes MoE across ep (test_train_ep)
def test_moe_checkpoints_resume_from_pp2_and_tp2_ep2_on_one_rank(tmp_path):
    """DCP: a pp2 and a tp2 x ep2 checkpoint (the stages' and the ep-sharded experts' global names
    and shapes) resume on one rank and continue the one-rank run within 1e-6."""
    ck_pp, ck_tp = str(tmp_path / "ck_pp"), str(tmp_path / "ck_tp")
    run_specs(
        tmp_path,
        2,
        {
            "pp2": {"pp": 2, "checkpoint_every": 2, "checkpoint_dir": ck_pp},
            "tp2_ep2": {"tp": 2, "ep": 2, "checkpoint_every": 2, "checkpoint_dir": ck_tp},
        },
    )
    one = run_specs(
        tmp_path,
        1,
        {
            "single": {"strategy": "single"},
            "from_pp2": {"strategy": "single", "resume_from": f"{ck_pp}/step-000002"},
            "from_tp2_ep2": {"strategy": "single", "resume_from": f"{ck_tp}/step-000002"},
        },
    )
    for name in ("from_pp2", "from_tp2_ep2"):
        for key in ("losses", "grad_norms"):
            err = max_rel(one[name][key], one["single"][key][2:])
            print(f"{name} {key} max rel diff {err:.1e}")
            assert err <= REL, (name, key)


def _one_rank_gets_no_rows(ctx) -> list[float]:
    """An MoE layer with a zero router gate: uniform scores, so top-2 picks the same two experts
    for every token (one rank's) and the other rank's experts receive no rows; forward and
    backward must still finish on both ranks (the dispatch's reverse all-to-all runs on both)."""
    from torch.distributed.device_mesh import init_device_mesh

    from dtrain.model.moe import MoE, init_moe
    from dtrain.parallel.ep.trainer_ep import apply_expert_parallel

    torch.manual_seed(0)
    moe = MoE(MoEArgs(experts=4, top_k=2, gemm="loop"), 16, 32, _linear, "mlp")
    init_moe(moe, 0.02, 0.02)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
    holder = torch.nn.ModuleList([moe])
    apply_expert_parallel(holder, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    x = torch.randn(2, 8, 16, requires_grad=True)
    moe(x).square().sum().backward()
    rows = [torch.zeros(1), torch.zeros(1)]
    torch.distributed.all_gather(rows, torch.tensor([float(moe.stats["rank_rows"])]))
    return [float(x.grad.norm()), sorted(float(r) for r in rows)]


def _linear(name, n_in, n_out, bias):
    return torch.nn.Linear(n_in, n_out, bias=bias)


def test_ep_backward_finishes_when_a_rank_gets_no_rows(tmp_path):
    cfg = local_cpu_run(2, timeout_s=60)
    (tmp_path / "run").mkdir()
    grad_norm, rows = launch(_one_rank_gets_no_rows, cfg, tmp_path / "run")[0]
    assert grad_norm > 0 and rows == [0, 2 * (2 * 8 * 2)]  # one rank computed both ranks' rows
