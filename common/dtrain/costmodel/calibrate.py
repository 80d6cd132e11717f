"""Calibrate the cost model from this cluster's run directories, with provenance.

Reads completed runs only through ``dtrain.results`` and only their typed guide inputs
(``dtrain.contract``, ``summary.json["guide_inputs"]``), never an experiment's name, config.yaml or
private files; env.json (the launcher's) gives the date. A run whose guide inputs break the
contract is skipped with a warning that names it. By record:

    CollectiveFit        all_reduce fits      -> α and achieved β per link class (intra / inter node)
    TrainingMeasurement  mfu, exposed comm    -> compute efficiency; overlap_fraction -> DP overlap
      (recipe None)      TP / PP layout runs'    tp_overhead (measured TP comm / α–β) and pp_overhead
                         layout + breakdown      (measured p2p + idle share / bubble formula), ``from_layout``
    TpMeasurement        per-tp rows          -> measured / α–β-modelled TP communication time
    Fp8Comparison        per-recipe factors   -> FP8 speed factor, memory factor, layers kept in BF16
    GemmProbe            e_max, w_half        -> GEMM achieved-fraction curve (``gemm_probe``); its
                         overheads[]             per-model fixed step overhead feeds the local checks
                                                 (step_overhead_s: their median, shown in the guide)

Derived runs (``dtrain.derived``) publish only what they derived, so each measurement is read once.

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

import dataclasses
import math
import statistics
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from dtrain import contract
from dtrain.results import Run, complete_runs
from dtrain.strategies import SHARDED

from .hardware import IB_ALPHA_S, NVLINK_ALPHA_S, Cluster, LinkModel
from .memory import Layout
from .timemodel import Calibration, Param, bubble_fraction, p2p_time, tp_comm_time

LINK_CLASSES = {"intra_node": "intra", "inter_node": "inter"}


@dataclass(frozen=True)
class Source:
    """The run a measured value comes from."""

    run: str
    date: str
    device: str
    backend: str
    world_size: int
    gpu_name: str | None = None

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def provenance(self, detail: str = "") -> str:
        what = self.gpu_name or self.device
        extra = f"; {detail}" if detail else ""
        return (f"measured here: {self.run}, {self.date}, {what} ({self.backend}, "
                f"{self.world_size} ranks){extra}")


@dataclass(frozen=True)
class Candidate:
    name: str
    value: float
    source: Source
    detail: str = ""

    def param(self) -> Param:
        return Param(self.value, self.source.provenance(self.detail))


@dataclass(frozen=True)
class LinkCalibration:
    """α per link class and the achieved share of the nominal rate (β measured / β datasheet)."""

    intra_alpha_s: Param
    intra_efficiency: Param
    inter_alpha_s: Param
    inter_efficiency: Param

    def apply(self, cluster: Cluster) -> Cluster:
        intra = LinkModel(self.intra_alpha_s.value, cluster.nvlink.beta_Bps * self.intra_efficiency.value,
                          cluster.nvlink.name)
        inter = LinkModel(self.inter_alpha_s.value, cluster.ib.beta_Bps * self.inter_efficiency.value,
                          cluster.ib.name)
        return replace(cluster, nvlink=intra, ib=inter)


def default_links() -> LinkCalibration:
    pub = "datasheet/published: "
    return LinkCalibration(
        Param(NVLINK_ALPHA_S, pub + "assumption, order of magnitude of nccl-tests small-message latency "
              "on an NVSwitch node (dtrain.costmodel.hardware.NVLINK_ALPHA_S)"),
        Param(1.0, pub + "datasheet per-direction NVLink/PCIe rate taken as the achievable bus bandwidth "
              "(an upper bound until allreduce-bench measures it on GPUs)"),
        Param(IB_ALPHA_S, pub + "assumption, a few µs per InfiniBand hop (dtrain.costmodel.hardware.IB_ALPHA_S)"),
        Param(1.0, pub + "NIC line rate taken as the achievable bus bandwidth (upper bound)"))


@dataclass
class CalibrationReport:
    cluster: Calibration
    cluster_links: LinkCalibration
    local: Calibration
    local_links: dict[str, LinkModel]          # "intra" / "inter" -> measured α–β of any device
    local_sources: dict[str, Source]           # which run each local link came from
    keep_bf16: tuple[list[str], str]           # layers to keep in BF16 on the cluster, provenance
    keep_bf16_local: tuple[list[str], str]     # the same from any device
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


@dataclass(frozen=True)
class RunInputs:
    """One run's guide inputs and where they were measured."""

    run: Run
    source: Source
    records: tuple

    def of(self, kind) -> list:
        return [r for r in self.records if isinstance(r, kind)]


def source_of(run: Run, base: Path | None = None, records=()) -> Source:
    """Provenance: where the records say they ran; the date and world size from env.json."""
    env, where = run.env, (records[0].where if records else None)
    device = str(where.device if where else env.get("device") or "unknown")
    gpus = env.get("gpus") or []
    gpu_name = (where.gpu_name if where else None) or (gpus[0].get("name") if gpus and device.startswith("cuda")
                                                        else None)
    return Source(run=display_path(run.path, base), date=str(env.get("created", "unknown date")), device=device,
                  backend=str(where.backend if where else env.get("backend") or "?"),
                  world_size=int(env.get("world_size") or 1), gpu_name=gpu_name)


def read_inputs(runs: list[Run], base: Path | None = None, warn: bool = True) -> list[RunInputs]:
    """Every run's records; a run that breaks the contract is left out (with a warning)."""
    out = []
    for run in runs:
        try:
            records = tuple(contract.read(run.summary))
        except contract.ContractError as e:
            if warn:
                warnings.warn(f"skipping run {run.path}: summary.json {e}", stacklevel=3)
            continue
        if not records and "guide" in run.summary and warn:  # written before dtrain.contract existed
            warnings.warn(f"run {run.path} has no guide_inputs (an older summary.json format): rerun it to "
                          "calibrate with it", stacklevel=3)
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


def _num(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


# ---------------------------------------------------------------- per record kind

def from_allreduce(fits: list[contract.CollectiveFit], src: Source) -> list[Candidate]:
    out = []
    for fit in map(dataclasses.asdict, fits):
        cls = LINK_CLASSES.get(fit.get("link_class"))
        alpha, beta = _num(fit.get("alpha_us")), _num(fit.get("beta_GBps"))
        if fit.get("collective") != "all_reduce" or cls is None or alpha is None or not beta:
            continue
        # The fit's α is the latency of a whole all_reduce over `world_size` ranks; the time model
        # charges α per ring hop, 2(n−1) of them, so convert to per-hop latency.
        n = int(fit.get("world_size") or 2)
        hops = 2 * (n - 1) if n > 1 else 1
        detail = (f"all_reduce {fit.get('dtype', '?')} fit over {n} ranks, {fit.get('n_points', '?')} sizes, "
                  f"r²={fit.get('r2', float('nan')):.3f}; α per hop = α/{hops}")
        out.append(Candidate(f"{cls}_alpha_s", max(alpha, 0.0) * 1e-6 / hops, src, detail))
        out.append(Candidate(f"{cls}_beta_Bps", beta * 1e9, src, detail))
        pct = _num(fit.get("beta_pct_of_theoretical"))
        if pct:
            out.append(Candidate(f"{cls}_efficiency", pct / 100, src, detail + f", {pct:.0f}% of nominal"))
    return out


def training_entry(m: contract.TrainingMeasurement) -> dict:
    """A training record as the flat dict the cost-model checks read (the trainer's vocabulary)."""
    lay = m.layout
    return {"strategy": lay.strategy, "world_size": lay.world_size, "dp": lay.dp, "tp": lay.tp, "pp": lay.pp,
            "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum, "seq_len": lay.seq_len,
            "pp_virtual": lay.pp_virtual, "pp_schedule": lay.pp_schedule, "model": dict(m.model),
            "step_time_s": m.step_time_s, "tokens_per_s": m.tokens_per_s, "mfu": m.mfu, "peak_flops": m.peak_flops,
            "peak_flops_source": m.peak_flops_source, "comm_s": m.comm_s, "exposed_comm_s": m.exposed_comm_s,
            "overlap_fraction": m.overlap_fraction, "mixed_precision": m.precision, "precision": m.precision,
            "recipe": m.recipe, "peak_mem_bytes": m.peak_mem_bytes, "device": m.where.device,
            "breakdown": dataclasses.asdict(m.breakdown) if m.breakdown else None,
            "step_callbacks": list(m.step_callbacks)}


def training_entries(inputs: RunInputs, recipe: bool = False) -> list[dict]:
    """The run's plain training records (they measure compute efficiency), or with ``recipe`` its
    numerics-recipe runs (fp8-train's), as ``training_entry`` dicts."""
    return [training_entry(m) for m in inputs.of(contract.TrainingMeasurement) if (m.recipe is not None) == recipe]


def from_fsdp(entries: list[dict], src: Source) -> list[Candidate]:
    out = []
    for g in entries:
        if (g.get("tp") or 1) * (g.get("pp") or 1) > 1:
            continue  # a TP / PP layout run: its step holds TP comm and bubble; the guide checks it instead
        step, mfu = _num(g.get("step_time_s")), _num(g.get("mfu"))
        exposed = _num(g.get("exposed_comm_s")) or 0.0
        if step and mfu and step > exposed:
            # compute-only efficiency: the time model costs communication separately
            eff = mfu * step / (step - exposed)
            out.append(Candidate("mfu", eff, src, f"{g.get('strategy')} x{g.get('world_size')}: MFU "
                                 f"{mfu:.1%} with {exposed / step:.0%} of the step exposed communication"))
        overlap = _num(g.get("overlap_fraction"))
        if overlap is not None and g.get("strategy") in SHARDED:
            out.append(Candidate("dp_overlap", overlap, src, f"{g.get('strategy')} x{g.get('world_size')}"))
    return out


def from_layout(entries: list[dict], src: Source, link: LinkModel | None) -> list[Candidate]:
    """TP and PP factors of DP x TP x PP layout runs (``training_entries``: the record's layout and
    its profiled step breakdown):

    tp_overhead  measured TP comm (profile) / ``timemodel.tp_comm_time`` (α–β with this device's link)
    pp_overhead  measured (PP p2p wait + idle) − α–β p2p sends, over compute + TP comm, / the bubble
                 formula ``bubble_fraction(p, m, v, L)`` (Narayanan et al. 2021), the factor the time
                 model puts on its bubble
    """
    from dtrain.fit import shape_of
    from dtrain.model import GPTConfig

    if link is None:
        return []
    out = []
    for g in entries:
        tp, pp, b = int(g["tp"]), int(g["pp"]), g.get("breakdown") or {}
        if tp * pp == 1 or not b:
            continue
        shape = shape_of(GPTConfig(**g["model"]))
        dp, mb, ga = int(g["dp"]), int(g["micro_batch"]), int(g["grad_accum"])
        v = int(g.get("pp_virtual") or 1) if pp > 1 else 1
        lay = Layout(dp, tp, pp, micro_batch=mb, grad_accum=ga, virtual_stages=v)
        vb = 4 if g.get("precision", "fp32") == "fp32" else 2
        name = f"dp{dp} x tp{tp} x pp{pp}"
        tp_meas = _num(b.get("tp_comm_s")) or 0.0
        if tp > 1 and tp_meas > 0:
            model = tp_comm_time(shape, lay, link, vb)
            out.append(Candidate("tp_overhead", tp_meas / model, src, f"{name}: TP comm measured {tp_meas * 1e3:.0f} ms "
                                 f"(profile) / alpha-beta {model * 1e3:.0f} ms"))
        compute = _num(b.get("compute_s"))
        if pp > 1 and compute:
            sends = 2 * v * ga * p2p_time(mb * shape.seq_len * shape.d_model * vb / tp, link)
            idle = max((_num(b.get("pp_p2p_s")) or 0.0) + (_num(b.get("idle_s")) or 0.0) - sends, 0.0)
            formula = bubble_fraction(pp, ga, v, shape.n_layer)
            share = idle / (compute + tp_meas)
            out.append(Candidate("pp_overhead", share / formula, src, f"{name}: p2p wait + idle {share:.0%} of compute "
                                 f"(profile) / bubble formula {formula:.0%}"))
    return out


def leave_one_out(cands: list[Candidate], name: str, run: str, on_gpu: bool = False) -> Candidate | None:
    """The median of every ``name`` value measured on this kind of device by a run other than ``run``
    (a display path, as ``Source.run``); None when no other run measured it."""
    pool = [c for c in cands if c.name == name and c.source.run != run and c.source.on_gpu == on_gpu]
    if not pool:
        return None
    vals = sorted(c.value for c in pool)
    med = statistics.median(vals)
    runs = ", ".join(f"{c.source.run} {c.value:.2f}" for c in sorted(pool, key=lambda c: c.source.run))
    return Candidate(name, med, pool[0].source, f"leave-one-out: median of {len(pool)} other run(s) ({runs})")


def tp_regions(module: str) -> int:
    """TP regions per layer: a block has two (attention, MLP), attention alone one."""
    return 1 if module == "attention" else 2


def tp_modelled_comm_s(row: dict, link: LinkModel, regions: int = 2) -> float:
    """α–β time of one layer's TP collectives, forward + backward. ``comm_bytes_per_layer`` is
    already in bus bytes (tp-attention's convention, = nccl-tests busbw bytes), so it goes over β
    unchanged; each region issues 2 all-reduces (or all-gather + reduce-scatter pairs with SP)
    per direction, 2(n−1) latency hops each (Megatron §3; Korthikanti §4.2.2)."""
    tp = int(row["tp"])
    return float(row["comm_bytes_per_layer"]) / link.beta_Bps + 4 * regions * (tp - 1) * link.alpha_s


def tp_rows(inputs: RunInputs) -> list[tuple[dict, int]]:
    """The run's TP layer records as the flat rows the checks read, each with its TP regions per layer."""
    return [({"tp": m.tp, "sequence_parallel": m.sequence_parallel, "step_time_s": m.step_time_s,
              "single_rank_step_time_s": m.single_rank_step_time_s, "dtensor_step_time_s": m.dtensor_step_time_s,
              "comm_share": m.comm_share, "comm_bytes_per_layer": m.comm_bytes_per_layer, "batch": m.micro_batch,
              "seq": m.seq_len, "d_model": m.d_model, "n_head": m.n_head, "n_kv_head": m.n_kv_head,
              "mlp_ratio": m.mlp_ratio}, tp_regions(m.module)) for m in inputs.of(contract.TpMeasurement)]


def from_tp(rows: list[tuple[dict, int]], src: Source, link: LinkModel | None) -> list[Candidate]:
    if link is None:
        return []
    ratios = []
    for row, regions in rows:
        step, share = _num(row.get("step_time_s")), _num(row.get("comm_share"))
        if not step or share is None or int(row.get("tp", 1)) < 2 or not row.get("comm_bytes_per_layer"):
            continue
        ratios.append(step * share / tp_modelled_comm_s(row, link, regions))
    if not ratios:
        return []
    ratios.sort()
    med = ratios[len(ratios) // 2]
    return [Candidate("tp_overhead", med, src, f"median over {len(ratios)} tp>1 rows of measured TP comm time "
                      "(profile) / alpha-beta time with this device's measured link")]


def from_fp8(comparisons: list[contract.Fp8Comparison], src: Source) -> tuple[list[Candidate], list[str] | None]:
    if not comparisons:
        return [], None
    recipes = {c.recipe: dataclasses.asdict(c) for c in comparisons}
    guide = {"baseline": comparisons[0].baseline, "keep_high_precision": comparisons[0].keep_high_precision}
    good = {k: v for k, v in recipes.items() if v.get("within_noise")} or recipes
    name = sorted(good, key=lambda k: (-(_num(good[k].get("speedup")) or 0), k))[0]
    r = good[name]
    detail = (f"recipe {name} vs {guide.get('baseline', '?')}"
              + ("" if r.get("within_noise") else ", NOT within the loss noise band"))
    out = []
    if _num(r.get("speedup")):
        out.append(Candidate("fp8_speedup", _num(r["speedup"]), src, detail))
    if _num(r.get("memory_factor")):
        out.append(Candidate("fp8_memory_factor", _num(r["memory_factor"]), src, detail + "; peak-memory ratio"))
    return out, list(guide.get("keep_high_precision") or [])


# ---------------------------------------------------------------- assembling

def probe_entry(m: contract.GemmProbe) -> dict:
    """A GEMM probe record as the dict the local checks read."""
    g = dataclasses.asdict(m)
    g["overheads"] = [{**{k: v for k, v in o.items() if k != "model_kind"}, "kind": o["model_kind"]}
                      for o in g["overheads"]]
    return g


def from_probe(g: dict, src: Source) -> list[Candidate]:
    e_max, w_half = _num(g.get("e_max")), _num(g.get("w_half"))
    if not e_max:
        return []
    detail = f"fit over {len(g.get('points') or [])} GEMM shapes of the runs' models, {g.get('dtype', '?')}"
    out = [Candidate("mfu", e_max, src, detail + "; e_max"), Candidate("gemm_half_flops", w_half or 0.0, src,
                                                                         detail + "; W_half")]
    over = [(o, _num(o.get("overhead_s"))) for o in g.get("overheads") or []]
    over = [(o, v) for o, v in over if v is not None]
    if over:
        per = ", ".join(f"{_target_label(o)} {v * 1e3:.1f} ms" for o, v in over)
        out.append(Candidate("step_overhead_s", statistics.median(v for _, v in over), src,
                             f"median over {len(over)} models of the measured step minus the curve's GEMM time "
                             f"(per model: {per}); the local checks use each model's own"))
    return out


def _target_label(o: dict) -> str:
    c = o.get("config") or {}
    if o.get("kind") == "gpt":
        return f"GPT {c.get('n_layer')}x{c.get('d_model')} mb{o.get('micro_batch')}"
    return f"{o.get('kind')} d{c.get('d_model')} mb{o.get('micro_batch')}"


def _latest(cands: list[Candidate], name: str, gpu_only: bool) -> Candidate | None:
    pool = [c for c in cands if c.name == name and (c.source.on_gpu or not gpu_only)]
    return max(pool, key=lambda c: (c.source.date, c.source.run)) if pool else None


def _calibration(cands: list[Candidate], gpu_only: bool) -> Calibration:
    calib = Calibration()
    for name in ("mfu", "gemm_half_flops", "step_overhead_s", "dp_overlap", "tp_overhead", "pp_overhead",
                 "fp8_speedup", "fp8_memory_factor"):
        best = _latest(cands, name, gpu_only)
        if best is not None:
            calib = replace(calib, **{name: best.param()})
    return calib


def _cluster_links(cands: list[Candidate]) -> LinkCalibration:
    links = default_links()
    for cls in ("intra", "inter"):
        for what in ("alpha_s", "efficiency"):
            best = _latest(cands, f"{cls}_{what}", gpu_only=True)
            if best is not None:
                links = replace(links, **{f"{cls}_{what}": best.param()})
    return links


def calibrate(paths, base: Path | None = None, warn: bool = True) -> CalibrationReport:
    """Calibration from every complete run under ``paths`` (missing paths raise FileNotFoundError)."""
    runs = complete_runs(paths, warn=warn) if paths else []
    runs = sorted(runs, key=lambda r: str(r.path))
    inputs = read_inputs(runs, base, warn)
    cands: list[Candidate] = []
    probes: list[tuple[Source, dict]] = []
    kept: list[tuple[Source, list[str]]] = []
    for ri in inputs:
        cands += from_allreduce(ri.of(contract.CollectiveFit), ri.source)
        cands += from_fsdp(training_entries(ri), ri.source)
        for m in ri.of(contract.GemmProbe):
            g = probe_entry(m)
            cands += from_probe(g, ri.source)
            probes.append((ri.source, g))
        found, layers = from_fp8(ri.of(contract.Fp8Comparison), ri.source)
        cands += found
        if layers is not None:
            kept.append((ri.source, layers))
    # local links: latest measured α–β per class, any device
    local_links, local_sources = {}, {}
    for cls in ("intra", "inter"):
        a, b = _latest(cands, f"{cls}_alpha_s", False), _latest(cands, f"{cls}_beta_Bps", False)
        if a and b:
            local_links[cls] = LinkModel(a.value, b.value, f"measured {cls}-node")
            local_sources[cls] = b.source
    # TP overhead and the PP bubble factor need the α–β of the same kind of device the run used
    for ri in inputs:
        link = _device_link(cands, ri.source.on_gpu)
        rows = tp_rows(ri)
        if rows:
            cands += from_tp(rows, ri.source, link)
        cands += from_layout(training_entries(ri), ri.source, link)
    return CalibrationReport(cluster=_calibration(cands, gpu_only=True), cluster_links=_cluster_links(cands),
                             local=_calibration(cands, gpu_only=False), local_links=local_links,
                             local_sources=local_sources, keep_bf16=_keep(kept, True),
                             keep_bf16_local=_keep(kept, False), candidates=cands, runs=[ri.run for ri in inputs],
                             probes=probes, inputs=inputs)


def _device_link(cands: list[Candidate], on_gpu: bool) -> LinkModel | None:
    pool = [c for c in cands if c.source.on_gpu == on_gpu]
    a, b = _latest(pool, "intra_alpha_s", False), _latest(pool, "intra_beta_Bps", False)
    return LinkModel(a.value, b.value) if a and b else None


KEEP_BF16_PUBLISHED = (["tok_emb", "lm_head"], "datasheet/published: convention, not a measurement: FP8 recipes "
                       "replace the GEMMs of the transformer blocks (TransformerEngine te.Linear, torchao "
                       "Float8Linear); the embedding is a lookup with no FP8 GEMM, and the output projection "
                       "is commonly left in BF16 because the logits need the widest range")


def _keep(kept: list[tuple[Source, list[str]]], gpu_only: bool) -> tuple[list[str], str]:
    pool = [(s, layers) for s, layers in kept if s.on_gpu or not gpu_only]
    if not pool:
        return KEEP_BF16_PUBLISHED
    src, layers = max(pool, key=lambda x: (x[0].date, x[0].run))
    return sorted(layers), src.provenance("fp8-train compare")
