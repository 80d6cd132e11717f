"""One step of `make gpu-check` (a command with a time limit) and what it measured (``Step``): its
numbers pulled out of what it printed or wrote, one collector per step kind (``COLLECT``). Numbers
come from each run's own summary.json (or a measurement's JSON line)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dtrain.results.loader import read_jsonl


@dataclass
class Step:
    name: str
    what: str
    command: list[str]
    limit_s: float
    kind: str = "measure"  # measure | fsdp | fp8 | tp | allreduce | pytest
    status: str = "not run"
    seconds: float = 0.0
    note: str = ""
    tail: str = ""
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def collect(self, stdout: str, folder: Path) -> None:
        """Pull the numbers out of what the step printed or wrote."""
        try:
            self.data = COLLECT[self.kind](stdout, folder)
        except Exception as e:  # noqa: BLE001
            # a step that ran but wrote nothing readable is reported, not fatal
            self.note = f"no result to read ({type(e).__name__}: {e})"[:300]


def _json_line(stdout: str, folder: Path) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def _summary(folder: Path) -> dict:
    [path] = [p for p in folder.rglob("summary.json") if ".hydra" not in p.parts]
    return json.loads(path.read_text())


def _losses(summary: dict) -> list[float]:
    """The run's loss at every step it recorded (records.jsonl beside its summary)."""
    run = Path(summary["run_dir"])
    recs = read_jsonl(run / "records.jsonl")
    return [r["loss"] for r in recs if r.get("kind") == "step" and r.get("loss") is not None]


def _fsdp(stdout: str, folder: Path) -> dict:
    g = _summary(folder)
    losses = _losses(g)
    return {
        "losses": losses,
        "first_loss": losses[0] if losses else None,
        "final_loss": g.get("final_loss"),
        "seq_len": g.get("seq_len"),
        "tokens_per_step": g.get("tokens_per_step"),
        **{
            k: g.get(k)
            for k in (
                "mfu",
                "tokens_per_s",
                "tflops_per_rank",
                "peak_mem_bytes",
                "peak_flops_source",
                "model_params",
                "step_time_s",
            )
        },
    }


def _fp8(stdout: str, folder: Path) -> dict:
    s = _summary(folder)
    losses = _losses(s)
    return {
        "losses": losses,
        "tokens_per_s": s.get("tokens_per_s"),
        "mfu": s.get("mfu"),
        "final_loss": s.get("final_loss"),
        "first_loss": losses[0] if losses else None,
        "precision": s.get("precision"),
        "peak_mem_bytes": s.get("peak_mem_bytes"),
        "notes": s.get("notes"),
    }


def _tp(stdout: str, folder: Path) -> dict:
    e = _summary(folder)["entries"][0]
    return {
        k: e.get(k)
        for k in ("tp", "tokens", "single_s", "handrolled_s", "handrolled_async_s", "dtensor_s")
    }


def _allreduce(stdout: str, folder: Path) -> dict:
    s = _summary(folder)
    return {
        "backend": s["backend"],
        "cases": s["cases"],
        "wrong_total": s["wrong_total"],
        "skipped": len(s["skipped"]),
    }


def _probe(stdout: str, folder: Path) -> dict:
    from dtrain.results import contract, contract_records

    [summary] = list(
        folder.parent.glob("gemm-probe/summary.json")
    )  # the probe's derived run, beside the steps
    [g] = [
        r
        for r in contract.read(json.loads(summary.read_text()))
        if isinstance(r, contract_records.GemmProbe)
    ]
    return {
        "run": str(summary.parent),
        "dtype": g.dtype,
        "e_max": g.e_max,
        "w_half": g.w_half,
        "points": len(g.points),
        "overheads": [(o.config.get("d_model"), o.step_s, o.overhead_s) for o in g.overheads],
    }


def _pytest(stdout: str, folder: Path) -> dict:
    last = [
        line
        for line in stdout.splitlines()
        if re.search(r"\d+ (passed|failed|error|skipped)", line)
    ][-1]
    return {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last)}


COLLECT = {
    "measure": _json_line,
    "probe": _probe,
    "fsdp": _fsdp,
    "fp8": _fp8,
    "tp": _tp,
    "allreduce": _allreduce,
    "pytest": _pytest,
}
