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


def _mask_groups(select: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    per_group = select.shape[1] // num_groups
    keep = torch.zeros(select.shape[0], num_groups, dtype=torch.bool, device=select.device)
    keep.scatter_(1, groups, True)
    return select.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))


def _grouped_topk(select: torch.Tensor, routing: RoutingConfig, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k. The group margin counts only where swapping the last kept group for the first
    dropped one would change the selected experts."""
    num_tokens, num_experts = select.shape
    num_groups, keep_groups = routing.num_expert_group, routing.topk_group
    group_scores = select.view(num_tokens, num_groups, num_experts // num_groups).topk(2, dim=-1).values.sum(dim=-1)
    group_values, group_order = torch.sort(group_scores, dim=-1, descending=True, stable=True)
    _, ids, margin = _stable_topk(_mask_groups(select, group_order[:, :keep_groups], num_groups), k)
    if keep_groups < num_groups:
        swapped = torch.cat([group_order[:, : keep_groups - 1], group_order[:, keep_groups : keep_groups + 1]], dim=1)
        _, alt_ids, _ = _stable_topk(_mask_groups(select, swapped, num_groups), k)
        changes = (ids.sort(dim=1).values != alt_ids.sort(dim=1).values).any(dim=1)
        group_margin = group_values[:, keep_groups - 1] - group_values[:, keep_groups]
        margin = torch.where(changes, torch.minimum(margin, group_margin), margin)
    return ids, margin


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
        if routing.num_expert_group is None:
            _, ids, margin = _stable_topk(select, k)
        else:
            ids, margin = _grouped_topk(select, routing, k)
        weights = scores.gather(1, ids)
        if routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"routing.scoring: unknown {scoring!r}")
    weights = weights * routing.routed_scaling_factor
    return RoutedTokens(weights.float(), ids.to(torch.int32), margin.float())
