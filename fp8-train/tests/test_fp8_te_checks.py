"""TransformerEngine glue without TransformerEngine: a package on sys.path that fails to import
as an ABI-mismatched build does, an old version, TE releases whose availability checks live in
transformer_engine.pytorch.fp8, and the run-shape rules checked before a run starts."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from conftest import py
from dtrain.core.errors import UserError
from fp8_train import recipes, te_backend

UNDEFINED = "libtransformer_engine.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev"


@pytest.fixture
def cuda_here(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))


def test_not_installed_says_how_to_install(cuda_here, monkeypatch):
    monkeypatch.setitem(
        sys.modules, "transformer_engine", None
    )  # import of it fails, as when absent
    monkeypatch.setattr(te_backend, "_installed", lambda name: False)
    with pytest.raises(UserError) as e:
        te_backend.check_available("te_delayed", "cuda")
    assert str(e.value) == (
        "recipe=te_* needs TransformerEngine, which is not installed: pip install "
        "--no-build-isolation 'transformer_engine[pytorch]>=2.3' (builds against the installed "
        "torch)"
    )


def test_a_broken_install_reports_its_real_cause(cuda_here, monkeypatch, tmp_path):
    pkg = tmp_path / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "2.4.0"\n')
    (pkg / "pytorch" / "__init__.py").write_text(f"raise OSError({UNDEFINED!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(UserError) as e:
        te_backend.check_available("te_current", "cuda")
    msg = str(e.value)
    assert "\n" not in msg and "not installed" not in msg
    assert msg.startswith(
        f"TransformerEngine is installed but does not import (OSError: {UNDEFINED}); "
        f"it must be built against this torch {torch.__version__}: pip install --no-build-isolation"
    )


def _stand_in(
    monkeypatch,
    version: str,
    top_level_checks: bool,
    mxfp8=(False, "Device compute capability 10.0 or higher required for MXFP8 execution."),
):
    root = types.ModuleType("transformer_engine")
    root.__version__ = version
    te = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    checks = {
        "fp8": lambda return_reason=False: (True, ""),
        "block": lambda return_reason=False: (
            False,
            "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9.",
        ),
        "mxfp8": lambda return_reason=False: mxfp8,
    }
    modules = {
        "transformer_engine": root,
        "transformer_engine.pytorch": te,
        "transformer_engine.common": common,
        "transformer_engine.common.recipe": recipe,
    }
    if top_level_checks:  # TE exports is_*_available(return_reason=...) at the top level
        te.is_fp8_available, te.is_fp8_block_scaling_available, te.is_mxfp8_available = (
            checks["fp8"],
            checks["block"],
            checks["mxfp8"],
        )
    else:  # older TE: the same checks, as check_*_support() in transformer_engine.pytorch.fp8
        legacy = types.ModuleType("transformer_engine.pytorch.fp8")
        legacy.check_fp8_support = lambda: checks["fp8"]()
        legacy.check_fp8_block_scaling_support = lambda: checks["block"]()
        legacy.check_mxfp8_support = lambda: checks["mxfp8"]()
        modules["transformer_engine.pytorch.fp8"] = legacy
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)


@pytest.mark.parametrize("top_level", [True, False])
def test_te_availability_checks_decide_per_recipe(cuda_here, monkeypatch, top_level):
    _stand_in(monkeypatch, "2.4.0", top_level)
    te_backend.check_available("te_delayed", "cuda")
    te_backend.check_available("te_current", "cuda")
    with pytest.raises(
        UserError,
        match=r"^recipe=te_block is not supported on this GPU \(compute capability 8.0, "
        r"CUDA .*\): FP8 block scaled GEMM requires compute capability 9.0",
    ):
        te_backend.check_available("te_block", "cuda")
    with pytest.raises(
        UserError, match="Device compute capability 10.0 or higher required for MXFP8"
    ):
        te_backend.check_available("te_mxfp8", "cuda")


def test_te_older_than_2_3_is_refused(cuda_here, monkeypatch):
    _stand_in(monkeypatch, "1.13.0", top_level_checks=False)
    with pytest.raises(
        UserError,
        match=r"^recipe=te_delayed needs TransformerEngine >= 2.3, found 1.13: pip install",
    ):
        te_backend.check_available("te_delayed", "cuda")


def test_activation_checkpointing_under_te_is_refused_clearly():
    with pytest.raises(
        UserError,
        match=r"train.activation_checkpointing=block with recipe=te_current: .*te.checkpoint",
    ):
        recipes.check_run("te_current", 8, 256, "block")
    recipes.check_run("emulated_delayed", 8, 256, "block")  # ours handles recomputation itself
    recipes.check_run("torchao_tensorwise", 8, 256, "block")


@pytest.mark.parametrize(
    "recipe, micro_batch, seq_len, multiple",
    [("te_delayed", 1, 24, 16), ("torchao_rowwise", 3, 12, 16), ("te_mxfp8", 1, 48, 32)],
)
def test_tokens_per_micro_batch_must_tile(recipe, micro_batch, seq_len, multiple):
    with pytest.raises(
        UserError,
        match=rf"tokens per micro-batch .* = {micro_batch * seq_len}\) to be a multiple "
        rf"of {multiple}",
    ):
        recipes.check_run(recipe, micro_batch, seq_len, "none")
    recipes.check_run(recipe, micro_batch, seq_len * multiple, "none")
    recipes.check_run(
        "emulated_current", micro_batch, seq_len, "none"
    )  # no FP8 GEMM kernel: no rule


def test_shape_rule_is_one_line_before_the_run(tmp_path):
    r = py(
        "-m",
        "fp8_train",
        "recipe=torchao_tensorwise",
        "model.seq_len=12",
        "train.micro_batch=1",
        f"results_dir={tmp_path}",
        timeout=120,
    )
    assert r.returncode == 2
    # (torchao's import may print a torch deprecation warning first: only our error line counts)
    assert [line for line in r.stderr.splitlines() if line.startswith("error")] == [
        "error: recipe=torchao_tensorwise: FP8 GEMMs need the tokens per micro-batch "
        "(train.micro_batch x seq_len = 1 x 12 = 12) to be a multiple of 16: change "
        "train.micro_batch or model.seq_len"
    ]
    assert not any(tmp_path.rglob("config.yaml"))
