"""The guide's MoE section (issue 41): cells computed by the MoE search, the EP-on-one-node rule
generated from them, the ρ sensitivity, and the section's table."""

from __future__ import annotations

from dtrain.costmodel import Calibration
from dtrain.guide.moe_guide import (
    MODELS,
    RHOS,
    MoECell,
    backtest_line,
    ep_rule,
    moe_cell,
    moe_section,
)


def test_cited_shapes_have_their_published_sizes():
    sizes = {name: (m.num_params() / 1e9, m.active_params() / 1e9) for name, m in MODELS.items()}
    # Mixtral paper 46.7B / 12.9B; Qwen3 cards 30.5B / 3.3B, 235B / 22B; DeepSeek-V3 671B / 37B
    want = {
        "Mixtral-8x7B": (46.7, 12.9),
        "Qwen3-30B-A3B": (30.5, 3.3),
        "Qwen3-235B-A22B": (235, 22),
        "DeepSeek-V3": (671, 37),
    }
    for name, (total, active) in want.items():
        got_total, got_active = sizes[name]
        assert abs(got_total / total - 1) < 0.01, name
        assert abs(got_active / active - 1) < 0.03, name


def test_one_node_cells_and_their_section():
    cells = [
        moe_cell(("Mixtral-8x7B", "b200", 8, Calibration(), None)),
        moe_cell(("Qwen3-30B-A3B", "h100-sxm", 8, Calibration(), None)),
        moe_cell(("DeepSeek-V3", "h100-sxm", 8, Calibration(), None)),
    ]
    mixtral, qwen, v3 = cells
    assert mixtral.best and qwen.best
    assert not v3.best and v3.need_gib > 80  # 671B parameters do not fit 8 H100s
    assert len(mixtral.rho_tokens_per_s) == len(RHOS)
    if qwen.ep == 1:  # EP = 1: uneven routing moves rows between a rank's experts, adds none
        assert all(t in (0.0, qwen.tokens_per_s) for t in qwen.rho_tokens_per_s)
    lines = moe_section(cells, [])
    assert lines[0] == "## Mixture of experts: expert parallelism"
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 3
    assert rows[2].startswith("| DeepSeek-V3 | 8 H100 | does not fit (needs ≥ ")
    rule = ep_rule(cells)
    assert rule.startswith("**When EP pays on one node.**")
    assert "Mixtral-8x7B on 8 B200" in rule and "Qwen3-30B-A3B on 8 H100" in rule


def test_rule_without_a_fitting_cell():
    assert "no MoE model" in ep_rule([MoECell("DeepSeek-V3", "h100-sxm", 8)])


def test_the_section_states_the_moe_backtest():
    from dtrain.costmodel.moe_backtest import moe_backtest

    line = backtest_line(moe_backtest())
    assert line.startswith("Against ") and "published MoE runs" in line
    assert backtest_line([]) == ""
