"""A torch twin of the routers (fp32), written for the benchmark's own needs.

Besides (topk_weights, topk_ids) it returns each token's selection margin: how far the k-th selected
expert's selection score is above the best unselected one (and, for group-limited routing, how far the
last kept group is above the best dropped group). Rows with a margin near zero have an ambiguous top-k:
two correct routers may pick different experts there, so the correctness check leaves them out.

Semantics follow moe2cta.router.Scoring (docs/design.md); ties go to the lower expert index (stable sort).
"""
from __future__ import annotations

import dataclasses

import torch

from moe2cta.router import RoutingConfig, Scoring

__all__ = ["RoutedTokens", "route_twin"]


@dataclasses.dataclass(frozen=True)
class RoutedTokens:
    topk_weights: torch.Tensor  # fp32 [T, k]
    topk_ids: torch.Tensor  # int32 [T, k]
    margin: torch.Tensor  # fp32 [T]; +inf when nothing could compete


def _stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [T,k], indices [T,k], margin [T]) with ties to the lower index."""
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    if k < scores.shape[-1]:
        margin = values[:, k - 1] - values[:, k]
        margin = torch.where(torch.isinf(values[:, k]), torch.full_like(margin, float("inf")), margin)
    else:
        margin = torch.full(scores.shape[:1], float("inf"), device=scores.device)
    return values[:, :k], order[:, :k], margin


def route_twin(
    logits: torch.Tensor, routing: RoutingConfig, e_score_correction_bias: torch.Tensor | None = None
) -> RoutedTokens:
    """fp32 routing of logits [T, E] per `routing`; see moe2cta.router.RoutingConfig."""
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [T, E], got shape {tuple(logits.shape)}")
    if not isinstance(routing, RoutingConfig):
        raise TypeError(f"routing: expected a RoutingConfig, got {type(routing).__name__}")
    num_tokens, num_experts = logits.shape
    routing.check_num_experts(num_experts)
    k = routing.top_k
    logits = logits.float()
    scoring = routing.scoring
    if scoring is Scoring.SOFTMAX:
        probs = torch.softmax(logits, dim=-1)
        _, ids, margin = _stable_topk(probs, k)
        weights = probs.gather(1, ids)
        if routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif scoring is Scoring.TOPK_SOFTMAX:
        values, ids, margin = _stable_topk(logits, k)
        weights = torch.softmax(values, dim=-1)
    elif scoring is Scoring.SIGMOID_TOP1:
        values, ids, margin = _stable_topk(logits, k)
        weights = torch.sigmoid(values)
    elif scoring is Scoring.SIGMOID_GROUPED:
        scores = torch.sigmoid(logits)
        select = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
        group_margin = None
        if routing.num_expert_group is not None:
            num_groups = routing.num_expert_group
            per_group = num_experts // num_groups
            group_scores = select.view(num_tokens, num_groups, per_group).topk(2, dim=-1).values.sum(dim=-1)
            _, kept, group_margin = _stable_topk(group_scores, routing.topk_group)
            keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=logits.device)
            keep.scatter_(1, kept, True)
            select = select.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
        _, ids, margin = _stable_topk(select, k)
        if group_margin is not None:
            margin = torch.minimum(margin, group_margin)
        weights = scores.gather(1, ids)
        if routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"routing.scoring: unknown {scoring!r}")
    weights = weights * routing.routed_scaling_factor
    return RoutedTokens(weights.float(), ids.to(torch.int32), margin.float())
