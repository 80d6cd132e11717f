"""One set of model shapes across the guide (issue 40): a size names one model in the decision
matrix, the long-context table, the rules and `dtrain plan --params`, each row cited."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dtrain.costmodel import ModelShape
from dtrain.costmodel.shapes import KNOWN_SHAPES, KNOWN_SOURCES
from dtrain.guide import long_context, matrix, models, rules

ROOT = Path(__file__).resolve().parents[1]


def test_matrix_long_context_and_plan_use_the_same_shapes():
    assert rules.MODELS is matrix.MODELS is models.MATRIX_MODELS
    for p in models.LONG_MODELS:
        label = models.model_label(p)
        long = long_context.SHAPES[label]
        assert long == replace(models.shape(p, matrix.SEQ_LEN), seq_len=long.seq_len)
        assert long == ModelShape.from_params(p, seq_len=long.seq_len)  # dtrain plan --params
    seventy = ModelShape.from_params(70e9)
    assert (seventy.name, seventy.n_layer, seventy.d_model, seventy.n_head) == (
        "Llama-3-70B",
        80,
        8192,
        64,
    )
    assert (seventy.n_kv_head, seventy.ffn_hidden, seventy.vocab, seventy.gated_mlp) == (
        8,
        28672,
        128256,
        True,
    )


def test_llama3_sizes_are_llama3_and_every_row_is_cited():
    assert set(KNOWN_SOURCES) == set(KNOWN_SHAPES)
    for p in (8e9, 70e9, 405e9):
        assert KNOWN_SHAPES[p].name.startswith("Llama-3")
        assert KNOWN_SOURCES[p].startswith("Llama Team 2024")
        assert p in models.MATRIX_MODELS and p in models.LONG_MODELS
    assert 7e9 not in models.MATRIX_MODELS  # 8B, Llama 3's size, replaces Llama 2's 7B


def test_models_section_lists_every_shape_with_its_source():
    text = "\n".join(models.models_section())
    sizes = sorted(set(models.MATRIX_MODELS) | set(models.LONG_MODELS))
    rows = [line for line in text.splitlines() if line.startswith("| ") and "B |" in line]
    assert len(rows) == len(sizes)
    row70 = next(r for r in rows if r.startswith("| 70B |"))
    assert row70 == (
        "| 70B | Llama-3-70B | 70.6B | 80 | 8,192 | 64 | 8 | 28,672 | yes | 128,256 | "
        + KNOWN_SOURCES[70e9]
        + " |"
    )


def test_the_committed_guide_names_one_70b():
    guide = (ROOT / "PARALLELISM_GUIDE.md").read_text()
    assert "### 70B — Llama-3-70B (70.6B parameters" in guide
    assert "Llama-2-70B" not in guide and "### 7B" not in guide
    assert "## Models" in guide and guide.index("## Models") < guide.index("## Decision matrix")
