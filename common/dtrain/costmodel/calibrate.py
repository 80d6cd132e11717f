"""Calibrate the cost model from this cluster's run directories, with provenance.

Reads completed runs only through ``dtrain.results.loader`` and only their typed guide inputs
(``dtrain.results.contract``, ``summary.json["guide_inputs"]``), never an experiment's name,
config.yaml or private files; env.json (the launcher's) gives the date. A run whose guide inputs
break the
contract is skipped with a warning that names it. By record:

    CollectiveFit        all_reduce fits      -> α and achieved β per link class (intra / inter
                                              node)
    TrainingMeasurement  mfu, exposed comm    -> compute efficiency; overlap_fraction -> DP overlap
      (recipe None)      TP / PP layout runs'    tp_overhead (measured TP comm / α–β) and
                                                 pp_overhead
                         layout + breakdown      (measured p2p + idle share / bubble formula),
                                                 ``from_layout``
    TpMeasurement        per-tp rows          -> measured / α–β-modelled TP communication time
    CpMeasurement        ring overlap_fraction -> cp_overlap (share of the K/V sends hidden),
                         ``from_cp``
    Fp8Comparison        per-recipe factors   -> FP8 speed factor, memory factor, layers kept in
                                              BF16
    GemmProbe            e_max, w_half        -> GEMM achieved-fraction curve (``gemm_probe``); its
                         overheads[]             per-model fixed step overhead feeds the local
                                                 checks
                                                 (step_overhead_s: their median, shown in the guide)

Derived runs (``dtrain.results.derived``) publish only what they derived, so each measurement is
read once.

Every value is a ``Param`` labelled "measured here: <run>, <date>, <device>" or
"datasheet/published: <source>". Two calibrations come out:

* ``cluster``: what the GPU decision matrix and ``dtrain plan`` use. Only runs whose device is
  CUDA count: a CPU/gloo measurement says nothing about an NVLink/InfiniBand cluster, so without
  GPU runs every value stays datasheet/published (and the guide says so).
* ``local``: every measured value whatever the device; the guide uses it to predict the local
  runs' step times (predicted-vs-measured table).
Among several runs for one value the latest (env.json ``created``, then path) wins;
``leave_one_out`` gives instead the median over every run but one (the local checks use it, so a
row is never predicted from a factor fitted on its own run).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from dtrain.results import contract, contract_records
from dtrain.results.loader import Run, complete_runs

from .calibration_links import OWN_FIT_HOPS, from_allreduce
from .calibration_probe import from_probe, probe_entry
from .calibration_records import Candidate, RunInputs, Source, training_entries
from .calibration_tp import from_cp, from_tp, tp_rows
from .calibration_training import from_fp8, from_fsdp, from_layout
from .hardware import LinkModel

# re-exported: calibrate's callers use them
from .links import LinkCalibration, default_links  # noqa: F401
from .calibration import Calibration, calibration_inputs


@dataclass
class CalibrationReport:
    cluster: Calibration
    cluster_links: LinkCalibration
    local: Calibration
    local_links: dict[str, LinkModel]  # "intra" / "inter" -> measured α–β of any device
    local_sources: dict[str, Source]  # which run each local link came from
    keep_bf16: tuple[list[str], str]  # layers to keep in BF16 on the cluster, provenance
    keep_bf16_local: tuple[list[str], str]  # the same from any device
    candidates: list[Candidate] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    probes: list[tuple[Source, dict]] = field(default_factory=list)  # gemm-probe guide dicts
    inputs: list[RunInputs] = field(default_factory=list)  # every run's records, in path order

    def local_probe(self) -> tuple[Source, dict] | None:
        """The latest non-CUDA gemm-probe (for the local predicted-vs-measured check)."""
        pool = [p for p in self.probes if not p[0].on_gpu and p[1].get("e_max")]
        return max(pool, key=lambda p: (p[0].date, p[0].run)) if pool else None

    @property
    def measured_on_gpu(self) -> bool:
        return any(c.source.on_gpu for c in self.candidates)


def source_of(run: Run, base: Path | None = None, records=()) -> Source:
    """Provenance: where the records say they ran; the date and world size from env.json."""
    env, where = run.env, (records[0].where if records else None)
    device = str(where.device if where else env.get("device") or "unknown")
    gpus = env.get("gpus") or []
    gpu_name = (where.gpu_name if where else None) or (
        gpus[0].get("name") if gpus and device.startswith("cuda") else None
    )
    return Source(
        run=display_path(run.path, base),
        date=str(env.get("created", "unknown date")),
        device=device,
        backend=str(where.backend if where else env.get("backend") or "?"),
        world_size=int(env.get("world_size") or 1),
        gpu_name=gpu_name,
    )


def read_inputs(runs: list[Run], base: Path | None = None, warn: bool = True) -> list[RunInputs]:
    """Every run's records; a run that breaks the contract is left out (with a warning)."""
    out = []
    for run in runs:
        try:
            records = tuple(contract.read(run.summary))
        except contract_records.ContractError as e:
            if warn:
                warnings.warn(f"skipping run {run.path}: summary.json {e}", stacklevel=3)
            continue
        if (
            not records and "guide" in run.summary and warn
        ):  # written before dtrain.results.contract existed
            warnings.warn(
                f"run {run.path} has no guide_inputs (an older summary.json format): rerun it to "
                "calibrate with it",
                stacklevel=3,
            )
        out.append(RunInputs(run, source_of(run, base, records), records))
    return out


def display_path(path: Path, base: Path | None = None) -> str:
    """A run path relative to ``base`` (the cwd by default), so guides do not embed /home/<user>."""
    path = Path(path).resolve()
    base = (base or Path.cwd()).resolve()
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def _latest(cands: list[Candidate], name: str, gpu_only: bool, prefer=None) -> Candidate | None:
    """The newest candidate called ``name``, those whose source ``prefer`` accepts first: the
    cluster values prefer the GPU being planned for (an H200 report committed after an H100 one
    must not stand in for the H100's values), the local ones this machine's own runs (not a
    committed GPU report's)."""
    pool = [c for c in cands if c.name == name and (c.source.on_gpu or not gpu_only)]
    return max(pool, key=lambda c: _rank(c.source, prefer)) if pool else None


def _rank(src: Source, prefer) -> tuple:
    """The order every calibrated value is picked in: a preferred source first, then the newest."""
    return prefer is not None and prefer(src), src.date, src.run


def _on(gpu: str | None):
    """The preference for runs on ``gpu`` (a hardware.yaml profile; None: no preference)."""
    return None if gpu is None else (lambda src: src.gpu_profile == gpu)


def _off_gpu(src: Source) -> bool:
    return not src.on_gpu


def _calibration(cands: list[Candidate], gpu_only: bool, prefer=None) -> Calibration:
    calib = Calibration()
    # every field; one no run measures yet (async_tp_hidden) keeps its published value
    for name in calibration_inputs():
        best = _latest(cands, name, gpu_only, prefer)
        if best is not None:
            calib = replace(calib, **{name: best.param()})
    return calib


def _cluster_links(cands: list[Candidate], gpu: str | None = None) -> LinkCalibration:
    links = default_links()
    for cls in ("intra", "inter"):
        for what in ("alpha_s", "efficiency"):
            best = _latest(cands, f"{cls}_{what}", True, _on(gpu))
            if best is not None:
                links = replace(links, **{f"{cls}_{what}": best.param()})
    return links


def calibrate(
    paths, base: Path | None = None, warn: bool = True, gpu: str | None = None
) -> CalibrationReport:
    """Calibration from every complete run under ``paths`` (missing paths raise
    FileNotFoundError); the cluster values prefer runs on ``gpu`` (the hardware.yaml profile
    being planned for), then any GPU."""
    runs = complete_runs(paths, warn=warn) if paths else []
    runs = sorted(runs, key=lambda r: str(r.path))
    inputs = read_inputs(runs, base, warn)
    cands: list[Candidate] = []
    probes: list[tuple[Source, dict]] = []
    kept: list[tuple[Source, list[str]]] = []
    for ri in inputs:
        cands += from_allreduce(ri.of(contract_records.CollectiveFit), ri.source)
        cands += from_fsdp(training_entries(ri), ri.source)
        cands += from_cp(ri.of(contract_records.CpMeasurement), ri.source)
        for m in ri.of(contract_records.GemmProbe):
            g = probe_entry(m)
            cands += from_probe(g, ri.source)
            probes.append((ri.source, g))
        found, layers = from_fp8(ri.of(contract_records.Fp8Comparison), ri.source)
        cands += found
        if layers is not None:
            kept.append((ri.source, layers))
    # local links: latest measured α–β per class, this machine's (off-GPU) runs first
    local_links, local_sources = {}, {}
    for cls in ("intra", "inter"):
        a, b = (
            _latest(cands, f"{cls}_alpha_s", False, _off_gpu),
            _latest(cands, f"{cls}_beta_Bps", False, _off_gpu),
        )
        if a and b:
            # collectives allreduce-bench fitted apart, from the same run as the all-reduce fit
            own = []
            for name in OWN_FIT_HOPS:
                ca, cb = (
                    _latest([c for c in cands if c.source == b.source], f"{cls}_{name}_{x}", False)
                    for x in ("alpha_s", "beta_Bps")
                )
                if ca and cb:
                    own.append((name, ca.value, cb.value))
            local_links[cls] = LinkModel(a.value, b.value, f"measured {cls}-node", tuple(own))
            local_sources[cls] = b.source
    # TP overhead and the PP bubble factor need the α–β of the same kind of device the run used
    for ri in inputs:
        link = _device_link(cands, ri.source.on_gpu)
        rows = tp_rows(ri)
        if rows:
            cands += from_tp(rows, ri.source, link)
        cands += from_layout(training_entries(ri), ri.source, link)
    return CalibrationReport(
        cluster=_calibration(cands, True, _on(gpu)),
        cluster_links=_cluster_links(cands, gpu),
        local=_calibration(cands, False, _off_gpu),
        local_links=local_links,
        local_sources=local_sources,
        keep_bf16=_keep(kept, True, gpu),
        keep_bf16_local=_keep(kept, False),
        candidates=cands,
        runs=[ri.run for ri in inputs],
        probes=probes,
        inputs=inputs,
    )


def calibrate_naming_skips(
    paths, base: Path | None = None, gpu: str | None = None
) -> tuple[CalibrationReport, list[str]]:
    """calibrate(), and one message per run it left out (incomplete, corrupt, breaking the contract:
    a newer schema_version, an unknown record kind), for a command to print: never dropped
    unnamed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = calibrate(paths, base=base, warn=True, gpu=gpu)
    return report, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _device_link(cands: list[Candidate], on_gpu: bool) -> LinkModel | None:
    pool = [c for c in cands if c.source.on_gpu == on_gpu]
    a, b = _latest(pool, "intra_alpha_s", False), _latest(pool, "intra_beta_Bps", False)
    return LinkModel(a.value, b.value) if a and b else None


KEEP_BF16_PUBLISHED = (
    ["tok_emb", "lm_head"],
    "datasheet/published: convention, not a measurement: FP8 recipes "
    "replace the GEMMs of the transformer blocks (TransformerEngine te.Linear, torchao "
    "Float8Linear); the embedding is a lookup with no FP8 GEMM, and the output projection "
    "is commonly left in BF16 because the logits need the widest range",
)


def _keep(
    kept: list[tuple[Source, list[str]]], gpu_only: bool, gpu: str | None = None
) -> tuple[list[str], str]:
    pool = [(s, layers) for s, layers in kept if s.on_gpu or not gpu_only]
    if not pool:
        return KEEP_BF16_PUBLISHED
    prefer = _on(gpu) if gpu_only else _off_gpu
    src, layers = max(pool, key=lambda x: _rank(x[0], prefer))
    return sorted(layers), src.provenance("fp8-train compare")
