"""Runs made from other runs: a study report, an FP8 comparison, the GEMM probe.

    write_derived_run(out, "fp8-train", sources=[run dirs], config={...}, summary={...},
                      guide_inputs=[Fp8Comparison(...)])

writes ``out`` as a run directory like any other (config.yaml, env.json, summary.json last and
atomic) whose summary names the run directories it was derived from (``derived_from``, relative
to ``out`` so a results tree can be moved or copied; ``dtrain.contract.derived_from`` resolves
them). It
publishes only what it derived (``dtrain.contract``): its sources keep their own records, so
calibration reads each measurement once, with no de-duplication.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from dtrain import contract
from dtrain.metrics import CONFIG, ENV, write_json_atomic, write_summary, write_text_atomic


def write_derived_run(out: str | Path, subproject: str, sources, config: dict, summary: dict,
                      guide_inputs=(), env: dict | None = None) -> Path:
    """``env`` defaults to the first source's env.json (where the measurements ran)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sources = [Path(s) for s in sources]
    names = [os.path.relpath(s.resolve(), out.resolve()) for s in sources]
    write_text_atomic(out / CONFIG, yaml.safe_dump({"subproject": subproject, **config,
                                                    contract.DERIVED_FROM: names}, sort_keys=True))
    if env is None and sources and (sources[0] / ENV).exists():
        env = json.loads((sources[0] / ENV).read_text())
    if env is not None:
        write_json_atomic(out / ENV, env)
    write_summary(out, {"subproject": subproject, "run_dir": str(out), "status": "complete", **summary,
                        contract.DERIVED_FROM: names, contract.KEY: list(guide_inputs)})
    return out
