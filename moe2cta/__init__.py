"""moe2cta: a Mixture-of-Experts layer for serving.

Routing, device-side dispatch, grouped GEMMs (torch twins, Triton, CuTe DSL sm_90 / sm_100 with 2-CTA work
units) and combine, behind one small API:

    import moe2cta
    out = moe2cta.fused_moe(hidden, w13, w2, router_logits, routing=moe2cta.RoutingConfig(top_k=8))
    layer = moe2cta.MoELayer(w13, w2, routing=..., backend="auto")   # weights prepared once
    layer = moe2cta.MoELayer(moe2cta.pack_gate_up_rows(w13), w2, routing=..., w13_layout="chunked")  # one copy
    graphed = moe2cta.GraphedMoELayer(layer, batch_sizes=[1, 2, 4, 8, 16, 32])  # eager callers: CUDA-graph replays
    ok, reason = moe2cta.is_supported("cute", hidden, w13, w2)
    from moe2cta import adapters   # the layer as torch.library ops for compiled models (torch.ops.moe2cta.*)

Importing moe2cta needs neither a GPU nor the CuTe DSL: kernels are imported and built when first used.
"""
from .api import BackendPlan, MoELayer, auto_triton_max_tokens, fused_moe, is_supported, route
from .config import Backend, Gemm1Input, IdCheck, MoEConfig
from .graphed import GraphedMoELayer, GraphInputs, GraphOutput
from .grouped_gemm import Activation
from .grouped_gemm.epilogue import W13Layout, pack_gate_up_rows, unpack_gate_up_rows
from .reference import RouterWeightOn, moe_forward_reference, moe_reference
from .router import RoutingConfig, Scoring

__version__ = "0.1.0"

__all__ = [
    "Activation",
    "Backend",
    "BackendPlan",
    "Gemm1Input",
    "GraphInputs",
    "GraphOutput",
    "GraphedMoELayer",
    "IdCheck",
    "MoEConfig",
    "MoELayer",
    "RouterWeightOn",
    "RoutingConfig",
    "Scoring",
    "W13Layout",
    "auto_triton_max_tokens",
    "fused_moe",
    "is_supported",
    "moe_forward_reference",
    "moe_reference",
    "pack_gate_up_rows",
    "route",
    "unpack_gate_up_rows",
    "__version__",
]
