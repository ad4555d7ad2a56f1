"""Torch twins of the router stage: scoring + top-k, dispatch metadata, gather, combine.

Straightforward, fp32, deterministic; every router kernel is checked against these. They run on CPU and
GPU. `dispatch_reference` builds the exact metadata of docs/design.md (padded layout) with sort-free,
stable integer arithmetic.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .config import RoutingConfig, Scoring

__all__ = [
    "Dispatch",
    "DEFAULT_TILE_HEIGHTS",
    "max_rows_for",
    "route_reference",
    "dispatch_reference",
    "gather_reference",
    "combine_reference",
]

DEFAULT_TILE_HEIGHTS = (16, 64, 128, 256)


class Dispatch(NamedTuple):
    """Device-side dispatch metadata (docs/design.md). All int32, sized from T, k, E and align only."""

    counts: torch.Tensor  # [E]
    token_offsets: torch.Tensor  # [E+1] compact exclusive prefix sum
    row_offsets: torch.Tensor  # [E+1] padded (multiples of align) exclusive prefix sum
    tile_offsets: torch.Tensor  # [len(tile_heights), E+1]
    sorted_slots: torch.Tensor  # [max_rows] slot t*k+j per padded row, -1 = padding
    slot_rows: torch.Tensor  # [T*k] padded row per slot, -1 = expert not on this rank
    align: int
    tile_heights: tuple


def max_rows_for(num_tokens: int, top_k: int, num_experts: int, align: int) -> int:
    """Static bound on padded rows: every slot, plus at most align-1 padding rows per expert."""
    return num_tokens * top_k + num_experts * (align - 1)


def _topk_lowest_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row; ties go to the lower index; result ordered by score desc.

    A stable descending sort keeps equal scores in index order, so the lower index wins a tie.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def route_reference(
    logits: torch.Tensor,
    config: RoutingConfig,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (topk_weights [T, k] fp32, topk_ids [T, k] int32).

    NaN logits: a NaN score never wins over a number (NaN is ordered below -inf for selection; a row of all
    NaN selects experts 0..k-1) and its weight is NaN, so the NaN propagates to that token's output only.
    +inf logits: softmax of a row with +inf gives NaN weights for that row (as torch.softmax); it never
    affects other tokens.
    """
    k = config.top_k
    x = logits.float()
    num_experts = x.shape[-1]
    # Selection key: NaN sorts below everything so that valid experts win.
    def key(s):
        return torch.where(torch.isnan(s), torch.full_like(s, -float("inf")), s) if s.is_floating_point() else s

    if config.scoring is Scoring.SOFTMAX:
        probs = torch.softmax(x, dim=-1)
        ids = _nan_last_topk(probs, k)
        weights = probs.gather(-1, ids)
        if config.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
    elif config.scoring is Scoring.TOPK_SOFTMAX:
        ids = _nan_last_topk(x, k)
        weights = torch.softmax(x.gather(-1, ids), dim=-1)
    elif config.scoring is Scoring.SIGMOID_TOP1:
        ids = _nan_last_topk(x, k)
        weights = torch.sigmoid(x.gather(-1, ids))
        if config.renormalize and k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
    elif config.scoring is Scoring.SIGMOID_GROUPED:
        scores = torch.sigmoid(x)
        biased = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
        if config.num_expert_group is not None:
            groups = config.num_expert_group
            per_group = num_experts // groups
            grouped = biased.view(*biased.shape[:-1], groups, per_group)
            top2 = torch.sort(key(grouped), dim=-1, descending=True, stable=True).values[..., :2]
            group_scores = top2.sum(-1)
            keep = _nan_last_topk(group_scores, config.topk_group)
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, keep, True)
            mask = mask.unsqueeze(-1).expand_as(grouped).reshape(biased.shape)
            biased = torch.where(mask, biased, torch.full_like(biased, -float("inf")))
        ids = _nan_last_topk(biased, k)
        weights = scores.gather(-1, ids)
        if config.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
    else:  # pragma: no cover - enum is closed
        raise ValueError(f"scoring: unknown {config.scoring!r}")
    weights = weights * config.routed_scaling_factor
    return weights.float().contiguous(), ids.to(torch.int32).contiguous()


def _nan_last_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    keyed = torch.where(torch.isnan(scores), torch.full_like(scores, -float("inf")), scores)
    # -inf (and NaN mapped to -inf) still orders by index among themselves: stable sort keeps index order.
    return _topk_lowest_index(keyed, k)


def dispatch_reference(
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    align: int = 128,
    tile_heights: tuple = DEFAULT_TILE_HEIGHTS,
    expert_map: torch.Tensor | None = None,
) -> Dispatch:
    """topk_ids [T, k] (global ids) -> Dispatch over num_experts local experts (docs/design.md)."""
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:  # ids past the map's end are off-rank, as in the Triton kernel
        in_map = (ids >= 0) & (ids < expert_map.shape[0])
        mapped = expert_map.long()[ids.clamp(min=0, max=max(expert_map.shape[0] - 1, 0))]
        local = torch.where(in_map, mapped, torch.full_like(ids, -1))
    else:
        local = ids
    # Ids outside [0, num_experts) are off-rank: they get no row (slot_rows -1), as in the Triton kernel.
    local = torch.where((local >= 0) & (local < num_experts), local, torch.full_like(local, -1))
    on_rank = local >= 0
    counts = torch.bincount(local[on_rank], minlength=num_experts)[:num_experts]
    token_offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    token_offsets[1:] = torch.cumsum(counts, 0)
    padded = (counts + align - 1) // align * align
    row_offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    row_offsets[1:] = torch.cumsum(padded, 0)
    tile_offsets = torch.zeros(len(tile_heights), num_experts + 1, dtype=torch.long, device=device)
    for i, h in enumerate(tile_heights):
        tile_offsets[i, 1:] = torch.cumsum((counts + h - 1) // h, 0)
    # Rank of each slot within its expert, in slot order (token, then j): a stable counting sort.
    slot_index = torch.arange(num_slots, device=device)
    order = torch.sort(torch.where(on_rank, local, torch.full_like(local, num_experts)), stable=True).indices
    sorted_local = local[order]
    position = torch.arange(num_slots, device=device)
    valid_sorted = sorted_local >= 0
    rank_in_expert = position - token_offsets[sorted_local.clamp(min=0)]
    rows_sorted = row_offsets[sorted_local.clamp(min=0)] + rank_in_expert
    slot_rows = torch.full((num_slots,), -1, dtype=torch.long, device=device)
    slot_rows[order[valid_sorted]] = rows_sorted[valid_sorted]
    max_rows = max_rows_for(num_tokens, top_k, num_experts, align)
    sorted_slots = torch.full((max_rows,), -1, dtype=torch.long, device=device)
    sorted_slots[rows_sorted[valid_sorted]] = slot_index[order[valid_sorted]]
    i32 = torch.int32
    return Dispatch(
        counts.to(i32),
        token_offsets.to(i32),
        row_offsets.to(i32),
        tile_offsets.to(i32),
        sorted_slots.to(i32),
        slot_rows.to(i32),
        align,
        tuple(tile_heights),
    )


def gather_reference(hidden: torch.Tensor, disp: Dispatch, top_k: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """a1[r] = hidden[sorted_slots[r] // k] (times scale[slot] when given); padding rows are zero."""
    slots = disp.sorted_slots.long()
    valid = slots >= 0
    a1 = torch.zeros(slots.shape[0], hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    rows = hidden[slots[valid] // top_k]
    if scale is not None:
        rows = (rows.float() * scale.reshape(-1)[slots[valid]].float().unsqueeze(1)).to(hidden.dtype)
    a1[valid] = rows
    return a1


def combine_reference(
    y: torch.Tensor,
    disp: Dispatch,
    topk_weights: torch.Tensor | None,
    num_tokens: int,
    top_k: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * y[slot_rows[t*k + j]], j in order, fp32; slots with row -1 add nothing."""
    out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    rows = disp.slot_rows.long().view(num_tokens, top_k)
    for j in range(top_k):
        r = rows[:, j]
        ok = r >= 0
        contrib = torch.zeros_like(out)
        contrib[ok] = y[r[ok]].float()
        if topk_weights is not None:
            contrib = contrib * topk_weights[:, j].float().unsqueeze(1)
        out += torch.where(ok.unsqueeze(1), contrib, torch.zeros_like(contrib))
    return out.to(out_dtype or y.dtype)
