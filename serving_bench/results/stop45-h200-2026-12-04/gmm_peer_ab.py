"""Stop 45: the torch._grouped_mm peer as it ran until stop 44 (activation and combine in fp32) beside the new one
(bf16 torch ops, bmm combine) and a variant combining by a bf16 multiply and sum. Registers the two extra forms as
benchmark backends and runs the serving benchmark on them, so every form passes the same fp32 check and timing.

    python gmm_peer_ab.py --out DIR [serving-bench arguments...]

(As run in call 1 the multiply + sum form called backends._activation_in_dtype, since moved unchanged into
epilogue.gated_activation.)
"""
import dataclasses
import sys

import torch

from moe2cta.grouped_gemm import apply_activation
from moe2cta.grouped_gemm.epilogue import gated_activation
from moe2cta.serving_bench import backends as B
from moe2cta.serving_bench.cli import main


def _build_fp32_combine(preset, weights):
    """The peer as it ran until stop 44."""
    w13_t, w2_t = weights.w13.transpose(-2, -1), weights.w2.transpose(-2, -1)
    b13, b2 = weights.b13, weights.b2
    inter, k, num_experts = preset.intermediate, preset.top_k, preset.num_experts

    def forward(hidden, logits):
        topk_weights, topk_ids = B.route_for_peers(logits, preset, weights)
        flat_ids = topk_ids.reshape(-1).long()
        sorted_ids, order = torch.sort(flat_ids, stable=True)
        counts = torch.zeros(num_experts, dtype=torch.int32, device=hidden.device)
        counts.index_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        token = order // k
        h = torch._grouped_mm(hidden[token], w13_t, offs=offs)
        if b13 is not None:
            h = h + b13[sorted_ids]
        a2 = apply_activation(h[:, :inter], h[:, inter:], preset.activation).to(hidden.dtype)
        y = torch._grouped_mm(a2, w2_t, offs=offs)
        if b2 is not None:
            y = y + b2[sorted_ids]
        scale = topk_weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        out.index_add_(0, token, y.float() * scale)
        return out.to(hidden.dtype)

    return forward


def _build_mul_sum_combine(preset, weights):
    """The new peer with the combine as a bf16 multiply, then a sum over the k slots."""
    w13_t, w2_t = weights.w13.transpose(-2, -1), weights.w2.transpose(-2, -1)
    b13, b2 = weights.b13, weights.b2
    inter, k, num_experts = preset.intermediate, preset.top_k, preset.num_experts

    def forward(hidden, logits):
        topk_weights, topk_ids = B.route_for_peers(logits, preset, weights)
        flat_ids = topk_ids.reshape(-1).long()
        sorted_ids, order = torch.sort(flat_ids, stable=True)
        counts = torch.zeros(num_experts, dtype=torch.int32, device=hidden.device)
        counts.index_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(hidden.index_select(0, order // k), w13_t, offs=offs)
        if b13 is not None:
            h += b13.index_select(0, sorted_ids)
        a2 = gated_activation(h[:, :inter], h[:, inter:], preset.activation)
        y = torch._grouped_mm(a2, w2_t, offs=offs)
        if b2 is not None:
            y += b2.index_select(0, sorted_ids)
        y_slots = torch.empty_like(y).index_copy_(0, order, y).view(hidden.shape[0], k, -1)
        return (y_slots * topk_weights.to(y.dtype).unsqueeze(2)).sum(1)

    return forward


base = B.BACKENDS["grouped-mm"]
B.BACKENDS["grouped-mm-fp32"] = dataclasses.replace(base, name="grouped-mm-fp32", build=_build_fp32_combine,
                                                    description="torch._grouped_mm peer until stop 44 (fp32 combine)")
B.BACKENDS["grouped-mm-mulsum"] = dataclasses.replace(base, name="grouped-mm-mulsum", build=_build_mul_sum_combine,
                                                      description="torch._grouped_mm peer, bf16 multiply + sum combine")
sys.exit(main(sys.argv[1:]))
