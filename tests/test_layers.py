"""No dtrain module imports up a layer (docs/ARCHITECTURE.md, "Layers"): every import, lazy ones
inside functions included, read from the source with `ast`."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "common" / "dtrain"
# Lowest first; every top-level module or package not named here is the base layer below them all.
LAYERS = [("parallel",), ("costmodel",), ("fit",), ("train",), ("guide", "gpucheck", "capstone", "cli", "cli_runs")]


def layer_of(module: str) -> int:
    """-1 for the base layer; `module` is dotted, e.g. dtrain.costmodel.memory."""
    top = module.split(".")[1] if "." in module else ""
    return next((i for i, names in enumerate(LAYERS) if top in names), -1)


def imports_of(source: str, package: str) -> set[str]:
    """Every dtrain module a file of `package` (dotted) imports, absolute or relative, at any depth."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            # `from dtrain import perf` imports the module dtrain.perf
            out |= {f"{target}.{a.name}" for a in node.names} if target.count(".") < 1 else {target}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("dtrain.")}


def modules():
    """(module, its package, source) of every dtrain file; an __init__'s package is itself."""
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        yield ".".join(parts).removesuffix(".__init__"), ".".join(parts[:-1]), path.read_text()


def test_no_module_imports_a_higher_layer():
    upward = [f"{module} -> {target}" for module, package, source in modules()
              for target in sorted(imports_of(source, package)) if layer_of(target) > layer_of(module)]
    assert upward == []


def test_the_checker_sees_the_upward_imports_issue_23_removed():
    lazy = "def f():\n    from dtrain.fit import shape_of\n    from .memory import Layout\n"
    assert imports_of(lazy, "dtrain.costmodel") == {"dtrain.fit", "dtrain.costmodel.memory"}
    assert layer_of("dtrain.fit") > layer_of("dtrain.costmodel.calibration_records")
    assert imports_of("from dtrain.costmodel.hardware import get_profile", "dtrain") == {"dtrain.costmodel.hardware"}
    assert layer_of("dtrain.costmodel.hardware") > layer_of("dtrain.perf")
    assert imports_of("from dtrain import perf, requeue", "dtrain.train") == {"dtrain.perf", "dtrain.requeue"}
