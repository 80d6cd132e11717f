"""No dtrain module imports up a layer (docs/ARCHITECTURE.md, "Layers") and no dtrain modules import
each other in a circle: every import, lazy ones inside functions included, read from the source
with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "common" / "dtrain"
# Lowest first, by dotted path below `dtrain` (the most specific entry wins: train.memory_fit, the
# check that a model fits in memory, sits between the cost model it reads and the trainer that runs
# it). Everything not named here (core, run, slurm, model, results, conf) is the base layer below
# them all.
LAYERS = [
    ("parallel",),
    ("costmodel",),
    ("train.memory_fit",),
    ("train",),
    ("guide", "gpucheck", "cli"),
]


def layer_of(module: str) -> int:
    """-1 for the base layer; `module` is dotted, e.g. dtrain.costmodel.memory."""
    path = module.split(".", 1)[1] if "." in module else ""
    best, depth = -1, 0
    for i, names in enumerate(LAYERS):
        for name in names:
            if (path == name or path.startswith(name + ".")) and name.count(".") + 1 > depth:
                best, depth = i, name.count(".") + 1
    return best


def modules():
    """(module, its package, source) of every dtrain file; an __init__'s package is itself."""
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        module = ".".join(parts).removesuffix(".__init__")
        yield module, module if parts[-1] == "__init__" else ".".join(parts[:-1]), path.read_text()


MODULES = {module for module, _, _ in modules()}


def imports_of(source: str, package: str, known: set[str] = MODULES) -> set[str]:
    """Every dtrain module a file of `package` (dotted) imports, absolute or relative, at any depth:
    `from dtrain.run import rundir` imports the module dtrain.run.rundir when `known` has it."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = (
                package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            )
            target = ".".join(base + ([node.module] if node.module else []))
            out |= {
                f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
                for a in node.names
            }
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("dtrain.")}


def graph(known: set[str] = MODULES, sources=None) -> dict[str, set[str]]:
    """module -> the dtrain modules it imports (itself and the packages above it left out: importing
    a package's module runs the package's __init__, which is no circle of ours)."""
    sources = sources if sources is not None else [(m, p, s) for m, p, s in modules()]
    return {
        m: {t for t in imports_of(s, p, known) if t != m and not m.startswith(t + ".")}
        for m, p, s in sources
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{module} -> {target}"
        for module, package, source in modules()
        for target in sorted(imports_of(source, package))
        if layer_of(target) > layer_of(module)
    ]
    assert upward == []


def test_no_import_circle():
    assert cycles(graph()) == []


def test_the_cycle_finder_sees_a_lazy_circle():
    known = {"dtrain.run.app", "dtrain.slurm.submitit_sweep", "dtrain.core.errors"}
    sources = [
        ("dtrain.run.app", "dtrain.run", "from dtrain.slurm import submitit_sweep\n"),
        (
            "dtrain.slurm.submitit_sweep",
            "dtrain.slurm",
            "def f():\n    from dtrain.run.app import fail\n    from dtrain.core.errors import "
            "UserError\n",
        ),
        ("dtrain.core.errors", "dtrain.core", ""),
    ]
    assert cycles(graph(known, sources)) == [["dtrain.run.app", "dtrain.slurm.submitit_sweep"]]


def test_the_checker_sees_the_upward_imports_issue_23_removed():
    lazy = (
        "def f():\n    from dtrain.train.memory_fit import shape_of\n    from .memory import "
        "Layout\n"
    )
    assert imports_of(lazy, "dtrain.costmodel") == {
        "dtrain.train.memory_fit",
        "dtrain.costmodel.memory",
    }
    assert layer_of("dtrain.train.memory_fit") > layer_of("dtrain.costmodel.calibration_records")
    assert (
        layer_of("dtrain.train.memory_fit")
        < layer_of("dtrain.train.run_checks")
        == layer_of("dtrain.train")
    )
    assert imports_of("from dtrain.costmodel.hardware import get_profile", "dtrain") == {
        "dtrain.costmodel.hardware"
    }
    assert layer_of("dtrain.costmodel.hardware") > layer_of("dtrain.model.perf")
    assert imports_of("from dtrain.model import perf", "dtrain.train") == {"dtrain.model.perf"}
    assert imports_of("from dtrain.run import requeue", "dtrain.train") == {"dtrain.run.requeue"}
    assert imports_of("from dtrain.train import memory_fit", "dtrain.train") == {
        "dtrain.train.memory_fit"
    }
