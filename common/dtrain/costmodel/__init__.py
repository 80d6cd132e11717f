"""dtrain.costmodel: analytic memory and step-time model of transformer training, and a search
over DP×TP×PP, ZeRO stage, recompute, micro-batch and sequence parallelism.

    from dtrain.costmodel import Cluster, ModelShape, search, explain
    cluster = Cluster.from_profile("h100-sxm", gpus=512, gpus_per_node=8)
    result = search(ModelShape.from_params(70e9), cluster, global_batch=1024)
    print("\\n".join(explain(result)))

Modules: ``hardware`` (GPU datasheets, links, cluster), ``shapes`` (``ModelShape``, ``Layout``),
``memory`` (bytes per GPU; its ``model_states`` and ``activations``), ``compute`` (the compute
terms), ``kernel_rates`` + ``kernels.yaml`` (each GPU's kernel rates), ``efficiency`` (GEMM
roofline × achieved-fraction curve),
``collectives`` (α–β times), ``calibration`` (the empirical inputs, with provenance),
``timemodel`` (seconds per step; its traffic ``step_comm``, its result ``step_breakdown``),
``search`` (the chooser), ``gemm_probe`` (the matmul probe that fits the curve), ``backtest``
(published GPU
runs). Model FLOPs: ``dtrain.model.flops``.
"""

from .hardware import Cluster, GPUProfile, LinkModel, get_profile, load_profiles
from .shapes import KNOWN_SHAPES, Layout, ModelShape
from .activations import activation_bytes_per_layer
from .memory import MemoryBreakdown, memory_per_gpu
from .model_states import model_state_bytes, params_per_gpu
from .explain import explain
from .search import Plan, SearchResult, search
from .calibration import Calibration, Param
from .collectives import all_gather_time, allreduce_time, group_link, p2p_time, reduce_scatter_time
from .step_breakdown import StepTime
from .timemodel import bubble_fraction, step_time

__all__ = [
    "Cluster",
    "GPUProfile",
    "LinkModel",
    "get_profile",
    "load_profiles",
    "KNOWN_SHAPES",
    "Layout",
    "MemoryBreakdown",
    "ModelShape",
    "activation_bytes_per_layer",
    "memory_per_gpu",
    "model_state_bytes",
    "params_per_gpu",
    "Plan",
    "SearchResult",
    "explain",
    "search",
    "Calibration",
    "Param",
    "StepTime",
    "all_gather_time",
    "allreduce_time",
    "bubble_fraction",
    "group_link",
    "p2p_time",
    "reduce_scatter_time",
    "step_time",
]
