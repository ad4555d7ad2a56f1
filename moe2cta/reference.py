"""Torch twin of the whole MoE forward, and an independent fp32 per-token definition.

`moe_forward_reference` runs the product's pipeline (route -> dispatch -> gather -> grouped GEMM1 ->
grouped GEMM2 -> combine) with the torch twins of each stage. `moe_reference` computes the same function
directly per token and slot, in fp32 (or fp64: the activation too), from (topk_weights, topk_ids): it is what every
backend is checked against. Both run their fp32 matmuls at torch's "highest" precision whatever the process set
(TF32 would be a reference less exact than the kernels it checks).
"""
from __future__ import annotations

import enum

import torch

from .grouped_gemm import Activation, apply_activation, grouped_gemm1_reference, grouped_gemm2_reference
from .grouped_gemm.epilogue import gated_activation
from .grouped_gemm.reference import fp32_matmuls
from .router import RoutingConfig
from .router.config import parse_enum
from .router.reference import combine_reference, dispatch_reference, gather_reference, route_reference

__all__ = ["RouterWeightOn", "moe_reference", "moe_forward_reference"]


class RouterWeightOn(enum.Enum):
    """Where the router weight multiplies: the expert output (usual) or the expert input (Llama4)."""

    OUTPUT = "output"
    INPUT = "input"

    @classmethod
    def parse(cls, value: "RouterWeightOn | str") -> "RouterWeightOn":
        return parse_enum(cls, value, "router_weight_on")


def moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation = Activation.SWIGLU,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    router_weight_on: RouterWeightOn = RouterWeightOn.OUTPUT,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """out[t] = sum_j w[t,j] * expert_{ids[t,j]}(hidden[t]) in `dtype` (fp32 default), per expert batched.

    Slots that are off-rank contribute zero, as in dispatch: an id outside [0, len(expert_map)) or a map entry
    outside [0, E) (-1 among them), and without expert_map an id outside [0, E). int64 values past int32 are off-rank,
    never wrapped.
    """
    activation = Activation.parse(activation)
    router_weight_on = RouterWeightOn.parse(router_weight_on)
    num_tokens = topk_ids.shape[0]
    x = hidden.to(dtype)
    out = torch.zeros(num_tokens, w2.shape[1], dtype=dtype, device=hidden.device)
    ids = topk_ids.long()
    if expert_map is not None:
        in_map = (ids >= 0) & (ids < expert_map.shape[0])
        mapped = expert_map.long()[ids.clamp(min=0, max=expert_map.shape[0] - 1)]
        ids = torch.where(in_map, mapped, torch.full_like(ids, -1))
    ids = torch.where((ids >= 0) & (ids < w13.shape[0]), ids, torch.full_like(ids, -1))
    weights = topk_weights.to(dtype)
    with fp32_matmuls():
        _per_slot(out, x, w13, w2, weights, ids, activation, b13, b2, router_weight_on, dtype)
    return out


def _per_slot(out, x, w13, w2, weights, ids, activation, b13, b2, router_weight_on, dtype) -> None:
    """moe_reference's sums into `out`, slot by slot in a fixed order."""
    top_k = ids.shape[1]
    intermediate = w13.shape[1] // 2
    for j in range(top_k):  # fixed slot order
        contrib = torch.zeros_like(out)
        for e in torch.unique(ids[:, j]).tolist():
            if e < 0:
                continue
            rows = (ids[:, j] == e).nonzero().squeeze(1)
            xe = x[rows]
            if router_weight_on is RouterWeightOn.INPUT:
                xe = xe * weights[rows, j].unsqueeze(1)
            h = xe @ w13[e].to(dtype).t()
            if b13 is not None:
                h = h + b13[e].to(dtype)
            gate, up = h[:, :intermediate], h[:, intermediate:]
            act = (gated_activation(gate, up, activation) if dtype == torch.float64  # fp64 throughout
                   else apply_activation(gate, up, activation).to(dtype))  # the kernels' fp32 epilogue
            y = act @ w2[e].to(dtype).t()
            if b2 is not None:
                y = y + b2[e].to(dtype)
            if router_weight_on is RouterWeightOn.OUTPUT:
                y = y * weights[rows, j].unsqueeze(1)
            contrib[rows] = y
        out += contrib


def moe_forward_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor | None,
    routing: RoutingConfig,
    *,
    topk_weights: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    activation: Activation = Activation.SWIGLU,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    router_weight_on: RouterWeightOn = RouterWeightOn.OUTPUT,
    align: int = 128,
) -> torch.Tensor:
    """The product's pipeline with torch twins at every stage; output in hidden.dtype. Routing comes either from
    router_logits or from (topk_weights, topk_ids), both given."""
    activation = Activation.parse(activation)
    router_weight_on = RouterWeightOn.parse(router_weight_on)
    if (topk_ids is None) != (topk_weights is None):
        raise ValueError("topk_weights, topk_ids: expected both or neither, got "
                         f"{'topk_ids' if topk_ids is not None else 'topk_weights'} alone")
    if topk_ids is not None and router_logits is not None:
        raise ValueError("router_logits: expected either router_logits or (topk_weights, topk_ids), got both")
    if topk_ids is None and router_logits is None:
        raise ValueError("router_logits: expected router_logits or (topk_weights, topk_ids), got neither")
    if topk_ids is None:
        topk_weights, topk_ids = route_reference(router_logits, routing, e_score_correction_bias)
    num_tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    disp = dispatch_reference(topk_ids, num_local, align=align, expert_map=expert_map)
    scale = topk_weights if router_weight_on is RouterWeightOn.INPUT else None
    a1 = gather_reference(hidden, disp, top_k, scale=scale)
    a2 = grouped_gemm1_reference(a1, w13, disp.row_offsets, disp.counts, activation, b13)
    y = grouped_gemm2_reference(a2, w2, disp.row_offsets, disp.counts, None, b2)
    weights = topk_weights if router_weight_on is RouterWeightOn.OUTPUT else None
    return combine_reference(y, disp, weights, num_tokens, top_k, out_dtype=hidden.dtype)
