"""Expert parallelism: routed experts sharded over ranks, token rows exchanged with all-to-all.

Arrangement (data-parallel tokens, expert-parallel weights). Every rank holds its own tokens
`hidden [T_r, H]` and the weights of its local experts only (`w13_local [E_local, 2I, H]`,
`w2_local [E_local, H, I]`). One forward, per rank:

    route (own tokens)            topk_ids [T, k] global ids, topk_weights [T, k] fp32
    send layout                   dest = owner(topk_ids); a Dispatch whose "experts" are the ranks
                                  (send_layout_for): slots grouped by destination rank, slot order inside
                                  each group; the router's gather writes the send buffer from it
    all-to-all #1                 token rows + their local expert ids -> owner ranks
    owner: dispatch/gather        the received rows are tokens with top_k = 1 over the local experts
    owner: grouped GEMM1, GEMM2   unweighted expert outputs y
    all-to-all #2                 y rows back to their source ranks, same positions as sent
    combine (source)              out[t] = sum_j w[t, j] * y[slot t*k+j], j in fixed order, fp32

The router weights never cross the wire: the source applies them in its combine (OUTPUT) or to the rows
before sending (INPUT, Llama4). With the same expert outputs the result is bit-identical to the
single-device layer (moe_forward_reference): combine runs the same fp32 arithmetic in the same slot order,
and each owner sees the same rows per expert, in the same order, as one device holding all tokens in rank
order would.

Transport: torch.distributed.all_to_all_single (NCCL on GPUs, gloo on CPU). Two modes (A2AMode):
- EXACT_SPLITS: the per-destination row counts are exchanged on the device (one all-to-all of W integers),
  then copied to the host once, because all_to_all_single takes its uneven split sizes as Python lists.
  That copy is the one host sync per step. Buffers hold exactly the routed rows; nothing is ever dropped.
- PADDED_CAPACITY: each destination gets a fixed block of C rows (C = capacity_per_peer, default T*k,
  which can never overflow); empty rows carry local id -1. Equal splits need no host sync, so with
  sync-free stages (router and grouped GEMM kernels) the step is CUDA-graph capturable. Cost: W*C rows
  move each way instead of the routed ones (W times more at the default C), and with C < T*k the slots
  beyond C for one destination (in slot order) are dropped: they contribute zero, like an unmapped expert
  (EPDispatched.num_dropped counts them on the device; capacity_per_peer_for sizes C from a capacity
  factor). Every rank must use the same C (with the default, the same T). This module's own steps (send
  layout, id lookup, both exchanges) never read device memory on the host in this mode.

Stages: `RankStages` names the callables used on each rank (route, dispatch, gather, combine, grouped
experts). The defaults are the torch twins, which run anywhere but do host syncs of their own on CUDA
(bincount, boolean indexing, .tolist()); GPU runs plug in the Triton / CuTe functions with the same
signatures.

Limits: an expert id outside [0, num_global_experts) is off-rank, as in the single-device dispatch: its slot is
sent nowhere and contributes zero (ep_fused_moe refuses such ids where they are on the CPU, as fused_moe's
IdCheck.AUTO does); num_global_experts >= world_size (every rank owns at least one expert); weights, hidden and logits
on the device of the process group's backend.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Callable, NamedTuple

import torch

from .config import IdCheck
from .grouped_gemm import Activation, grouped_gemm1_reference, grouped_gemm2_reference
from .reference import RouterWeightOn
from .router import RoutingConfig
from .router.reference import (
    Dispatch,
    combine_reference,
    dispatch_reference,
    gather_reference,
    route_reference,
)
from .validation import FLOAT_DTYPES, check_topk, check_weights, require_tensor, validate_moe

__all__ = [
    "ExpertPlacement",
    "A2AMode",
    "ExpertParallelConfig",
    "capacity_per_peer_for",
    "expert_owner_and_local_id",
    "expert_map_for",
    "local_expert_ids",
    "shard_experts",
    "torch_grouped_experts",
    "send_layout_for",
    "RankStages",
    "TORCH_STAGES",
    "EPDispatched",
    "ep_dispatch",
    "ep_expert_compute",
    "ep_combine",
    "ep_fused_moe",
]


class ExpertPlacement(enum.Enum):
    """Which rank owns which global expert.

    CONTIGUOUS: rank r owns a contiguous block of ids; when E % W != 0 the first E % W ranks own one more.
    ROUND_ROBIN: expert e lives on rank e % W with local id e // W.
    """

    CONTIGUOUS = "contiguous"
    ROUND_ROBIN = "round_robin"

    @classmethod
    def parse(cls, value: "ExpertPlacement | str") -> "ExpertPlacement":
        if isinstance(value, cls):
            return value
        for member in cls:
            if str(value).lower() in (member.value, member.name.lower()):
                return member
        raise ValueError(f"placement: expected one of {[m.value for m in cls]}, got {value!r}")


class A2AMode(enum.Enum):
    """How token rows are exchanged (module docstring: trade-off)."""

    EXACT_SPLITS = "exact_splits"  # exact row counts; one host sync per step for the split lists
    PADDED_CAPACITY = "padded_capacity"  # fixed C rows per peer; no host sync; may drop beyond C

    @classmethod
    def parse(cls, value: "A2AMode | str") -> "A2AMode":
        if isinstance(value, cls):
            return value
        for member in cls:
            if str(value).lower() in (member.value, member.name.lower()):
                return member
        raise ValueError(f"a2a_mode: expected one of {[m.value for m in cls]}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ExpertParallelConfig:
    """Static facts of one rank in an expert-parallel group.

    world_size: ranks in the group. rank: this rank (0..world_size-1). num_global_experts: E over all
    ranks. placement: ExpertPlacement. a2a_mode: A2AMode. capacity_per_peer: rows each rank sends to each
    peer in PADDED_CAPACITY mode (None = T*k, never drops); must be None in EXACT_SPLITS mode.
    """

    world_size: int
    rank: int
    num_global_experts: int
    placement: ExpertPlacement = ExpertPlacement.CONTIGUOUS
    a2a_mode: A2AMode = A2AMode.EXACT_SPLITS
    capacity_per_peer: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "placement", ExpertPlacement.parse(self.placement))
        object.__setattr__(self, "a2a_mode", A2AMode.parse(self.a2a_mode))
        if not _is_int(self.world_size) or self.world_size < 1:
            raise ValueError(f"world_size: expected an int >= 1, got {self.world_size!r}")
        if not _is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: expected an int in [0, {self.world_size}), got {self.rank!r}")
        if not _is_int(self.num_global_experts) or self.num_global_experts < self.world_size:
            raise ValueError(
                f"num_global_experts: expected an int >= world_size ({self.world_size}), "
                f"got {self.num_global_experts!r}"
            )
        if self.capacity_per_peer is not None:
            if self.a2a_mode is not A2AMode.PADDED_CAPACITY:
                raise ValueError(
                    f"capacity_per_peer: only meaningful with a2a_mode=PADDED_CAPACITY, got {self.capacity_per_peer!r}"
                    f" with {self.a2a_mode}"
                )
            if not _is_int(self.capacity_per_peer) or self.capacity_per_peer < 1:
                raise ValueError(f"capacity_per_peer: expected an int >= 1 or None, got {self.capacity_per_peer!r}")

    @property
    def num_local_experts(self) -> int:
        return len(local_expert_ids(self.rank, self.world_size, self.num_global_experts, self.placement))

    def for_rank(self, rank: int) -> "ExpertParallelConfig":
        """The same group seen from another rank."""
        return dataclasses.replace(self, rank=rank)


def capacity_per_peer_for(num_tokens: int, top_k: int, world_size: int, capacity_factor: float = 1.0) -> int:
    """PADDED_CAPACITY rows per peer for a capacity factor: ceil(factor * T*k / W), within [1, T*k].

    factor 1.0 fits a perfectly balanced routing; factor >= W (math.inf included, or capacity None) never drops.
    """
    for name, value, least in (("num_tokens", num_tokens, 0), ("top_k", top_k, 1), ("world_size", world_size, 1)):
        if not _is_int(value) or value < least:
            raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0:
        raise ValueError(f"capacity_factor: expected a number > 0 (math.inf: never drop), got {capacity_factor!r}")
    slots = num_tokens * top_k
    if capacity_factor >= world_size:
        return max(1, slots)
    return max(1, min(slots, math.ceil(capacity_factor * slots / world_size)))


def expert_owner_and_local_id(
    ids: torch.Tensor, world_size: int, num_global_experts: int, placement: ExpertPlacement
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global expert ids (any int tensor) -> (owner rank, local id on that rank), both int64, same shape; (-1, -1)
    for an id outside [0, num_global_experts) (off-rank everywhere).

    Pure elementwise arithmetic on the ids' device: no table, no host sync.
    """
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    if not _is_int(num_global_experts) or num_global_experts < world_size:
        raise ValueError(
            f"num_global_experts: expected an int >= world_size ({world_size}), got {num_global_experts!r}"
        )
    placement = ExpertPlacement.parse(placement)
    ids = ids.long()
    valid = (ids >= 0) & (ids < num_global_experts)
    if placement is ExpertPlacement.ROUND_ROBIN:
        owner, local = ids % world_size, ids // world_size
    else:
        base, extra = divmod(num_global_experts, world_size)
        boundary = extra * (base + 1)  # the first `extra` ranks own base + 1 experts each
        head = ids < boundary
        rest = (ids - boundary).clamp(min=0)
        owner = torch.where(head, ids // (base + 1), extra + rest // base)
        local = torch.where(head, ids % (base + 1), rest % base)
    off_rank = torch.full_like(ids, -1)
    return torch.where(valid, owner, off_rank), torch.where(valid, local, off_rank)


def local_expert_ids(
    rank: int, world_size: int, num_global_experts: int, placement: ExpertPlacement = ExpertPlacement.CONTIGUOUS
) -> list[int]:
    """Global ids of rank's experts, in local-id order (local id i holds global expert result[i])."""
    if not _is_int(rank) or not _is_int(world_size) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    owner, local = expert_owner_and_local_id(torch.arange(num_global_experts), world_size, num_global_experts, placement)
    mine = [(int(l), e) for e, (o, l) in enumerate(zip(owner.tolist(), local.tolist())) if o == rank]
    return [e for _, e in sorted(mine)]


def expert_map_for(
    rank: int,
    world_size: int,
    num_global_experts: int,
    placement: ExpertPlacement = ExpertPlacement.CONTIGUOUS,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[num_global_experts] int32: global id -> local id on `rank`, or -1 (docs/design.md expert_map)."""
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    ids = torch.arange(num_global_experts, device=device)
    owner, local = expert_owner_and_local_id(ids, world_size, num_global_experts, placement)
    return torch.where(owner == rank, local, torch.full_like(local, -1)).to(torch.int32)


def shard_experts(weight: torch.Tensor | None, ep_config: ExpertParallelConfig) -> torch.Tensor | None:
    """weight [E_global, ...] (w13, w2, b13 or b2) -> this rank's [E_local, ...] in local-id order."""
    if weight is None:
        return None
    if weight.shape[0] != ep_config.num_global_experts:
        raise ValueError(
            f"weight: expected leading dim num_global_experts={ep_config.num_global_experts}, got {tuple(weight.shape)}"
        )
    ids = local_expert_ids(ep_config.rank, ep_config.world_size, ep_config.num_global_experts, ep_config.placement)
    return weight.index_select(0, torch.tensor(ids, device=weight.device)).contiguous()


def torch_grouped_experts(
    a1: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    disp: Dispatch,
    activation: Activation,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
) -> torch.Tensor:
    """GEMM1 (+activation) then GEMM2, unweighted, with the torch twins: a1 [max_rows, H] -> y [max_rows, H].

    Kernels take plain tensors from `disp` (row_offsets, counts, tile_offsets); padding rows are not read.
    """
    a2 = grouped_gemm1_reference(a1, w13, disp.row_offsets, disp.counts, activation, b13)
    return grouped_gemm2_reference(a2, w2, disp.row_offsets, disp.counts, None, b2)


@dataclasses.dataclass(frozen=True)
class RankStages:
    """The per-rank stage functions, with the signatures of the torch twins (docs/design.md).

    route(logits, routing, bias) -> (weights, ids); dispatch(ids, E, align=, expert_map=) -> Dispatch;
    gather(hidden, disp, top_k, scale=) -> a1; combine(y, disp, weights, T, k, out_dtype=) -> out;
    grouped_experts(a1, w13, w2, disp, activation, b13, b2) -> y (unweighted, rows of the padded layout).
    """

    route: Callable = route_reference
    dispatch: Callable = dispatch_reference
    gather: Callable = gather_reference
    combine: Callable = combine_reference
    grouped_experts: Callable = torch_grouped_experts


TORCH_STAGES = RankStages()


class EPDispatched(NamedTuple):
    """What ep_dispatch hands to ep_expert_compute (recv_*) and to ep_combine (the rest)."""

    recv_rows: torch.Tensor  # [N_recv, H] token rows this rank's experts must process
    recv_local_ids: torch.Tensor  # [N_recv] int32 local expert id per row, -1 = empty (padded) row
    send_layout: Dispatch  # source side: slot t*k+j -> row of the send (and returned) buffer
    combine_weights: torch.Tensor | None  # [T, k] fp32 for OUTPUT, None for INPUT (applied before sending)
    num_tokens: int
    top_k: int
    send_splits: list | None  # rows sent to each rank (EXACT_SPLITS), None when padded
    recv_splits: list | None  # rows received from each rank (EXACT_SPLITS), None when padded
    num_dropped: torch.Tensor  # [] int64 on device: slots dropped by capacity (always 0 in EXACT_SPLITS; off-rank ids not counted)
    num_local_experts: int = 0  # this rank's experts (ep_config.num_local_experts): ep_expert_compute's weights


def _all_to_all(out, inp, out_splits, in_splits, group, world_size: int) -> None:
    if world_size == 1:
        out.copy_(inp)
        return
    import torch.distributed as dist

    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


def _check_group(ep_config: ExpertParallelConfig, group) -> None:
    """The process group must agree with the config (host-side facts only, no device sync)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if ep_config.world_size != 1:
            raise ValueError(
                f"group: torch.distributed is not initialized but ep_config.world_size={ep_config.world_size}"
            )
        return
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if (world, rank) != (ep_config.world_size, ep_config.rank):
        raise ValueError(
            f"ep_config: (world_size, rank)=({ep_config.world_size}, {ep_config.rank}) but the group has ({world}, {rank})"
        )


def send_layout_for(dest: torch.Tensor, world_size: int, capacity: int | None = None) -> Dispatch:
    """dest [T, k] owner rank of each slot -> the send layout, a Dispatch whose "experts" are the ranks. A slot whose
    dest is outside [0, world_size) (an off-rank expert id: -1) is sent nowhere (slot_rows -1).

    capacity None (EXACT_SPLITS): compact, align 1: rank d's rows are token_offsets[d] ..
    token_offsets[d+1], in slot order; max_rows = T*k. capacity C (PADDED_CAPACITY): rank d's rows start
    at d*C; slots past the C-th one for a rank (in slot order) get slot_rows -1 and are dropped;
    max_rows = W*C. gather / combine read it like any Dispatch (sorted_slots, slot_rows); tile_offsets is
    empty (no GEMM runs over this layout). Sync-free: one-hot prefix sums, no sort, no bincount.
    """
    device = dest.device
    flat = dest.reshape(-1).long()
    num_slots = flat.numel()
    sent = (flat >= 0) & (flat < world_size)
    flat = torch.where(sent, flat, torch.zeros_like(flat))  # an index for the lookups below; `sent` masks it
    onehot = ((flat.unsqueeze(1) == torch.arange(world_size, device=device)) & sent.unsqueeze(1)).long()  # [S, W]
    position = torch.cumsum(onehot, 0).gather(1, flat.unsqueeze(1)).squeeze(1) - 1
    counts = onehot.sum(0)
    token_offsets = torch.zeros(world_size + 1, dtype=torch.long, device=device)
    if capacity is None:
        total, align = num_slots, 1
        token_offsets[1:] = torch.cumsum(counts, 0)
        row_offsets = token_offsets
        keep = sent
        rows = token_offsets[flat] + position
    else:
        total, align = world_size * capacity, capacity
        counts = counts.clamp(max=capacity)
        token_offsets[1:] = torch.cumsum(counts, 0)
        row_offsets = torch.arange(world_size + 1, device=device) * capacity
        keep = sent & (position < capacity)
        rows = flat * capacity + position
    rows = torch.where(keep, rows, torch.full_like(rows, -1))
    sorted_slots = torch.full((total + 1,), -1, dtype=torch.long, device=device)
    target = torch.where(keep, rows, torch.full_like(rows, total))  # dropped slots write one spare row
    sorted_slots.index_put_((target,), torch.arange(num_slots, device=device))
    i32 = torch.int32
    return Dispatch(
        counts.to(i32),
        token_offsets.to(i32),
        row_offsets.to(i32),
        torch.zeros(0, world_size + 1, dtype=i32, device=device),
        sorted_slots[:total].to(i32),
        rows.to(i32),
        align,
        (),
    )


def ep_dispatch(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    ep_config: ExpertParallelConfig,
    group=None,
    *,
    router_weight_on: RouterWeightOn = RouterWeightOn.OUTPUT,
    stages: RankStages = TORCH_STAGES,
) -> EPDispatched:
    """Send each slot's token row (and its local expert id) to the rank owning its expert."""
    if not isinstance(ep_config, ExpertParallelConfig):
        raise TypeError(f"ep_config: expected an ExpertParallelConfig, got {type(ep_config).__name__}")
    require_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    check_topk(topk_weights, topk_ids, hidden.shape[0], ep_config.num_global_experts)
    if topk_ids.device != hidden.device:
        raise ValueError(f"topk_ids: expected a tensor on {hidden.device} (the device of hidden), got {topk_ids.device}")
    router_weight_on = RouterWeightOn.parse(router_weight_on)
    world = ep_config.world_size
    num_tokens, top_k = topk_ids.shape
    device = hidden.device
    owner, local = expert_owner_and_local_id(
        topk_ids, world, ep_config.num_global_experts, ep_config.placement
    )
    local_of_slot = local.reshape(-1).to(torch.int32)
    scale = topk_weights if router_weight_on is RouterWeightOn.INPUT else None
    combine_weights = topk_weights if router_weight_on is RouterWeightOn.OUTPUT else None
    exact = ep_config.a2a_mode is A2AMode.EXACT_SPLITS
    capacity = None if exact else (ep_config.capacity_per_peer or num_tokens * top_k)
    send_layout = send_layout_for(owner, world, capacity)
    send_rows = stages.gather(hidden, send_layout, top_k, scale=scale)  # [T*k or W*C, H]
    slots = send_layout.sorted_slots.long()
    # Empty (padded) rows read a trailing -1 entry: the lookup works even with no tokens at all.
    lookup = torch.cat([local_of_slot, torch.full((1,), -1, dtype=torch.int32, device=device)])
    send_ids = lookup[torch.where(slots >= 0, slots, torch.full_like(slots, local_of_slot.numel()))]
    if exact:
        send_counts = send_layout.counts.to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        _all_to_all(recv_counts, send_counts, None, None, group, world)  # counts exchanged on the device
        send_splits, recv_splits = torch.stack([send_counts, recv_counts]).tolist()  # THE host sync of the step
        # the sent rows lead the send buffer; rows past them belong to off-rank slots, which go nowhere
        send_rows, send_ids = send_rows[:sum(send_splits)], send_ids[:sum(send_splits)]
        num_recv = sum(recv_splits)
        recv_rows = torch.empty(num_recv, hidden.shape[1], dtype=hidden.dtype, device=device)
        recv_ids = torch.empty(num_recv, dtype=torch.int32, device=device)
    else:
        send_splits = recv_splits = None  # equal blocks of C rows: no split lists, no host sync
        recv_rows = torch.empty_like(send_rows)
        recv_ids = torch.empty_like(send_ids)
    _all_to_all(recv_rows, send_rows, recv_splits, send_splits, group, world)
    _all_to_all(recv_ids, send_ids, recv_splits, send_splits, group, world)
    num_dropped = ((send_layout.slot_rows < 0) & (owner.reshape(-1) >= 0)).sum()
    return EPDispatched(
        recv_rows, recv_ids, send_layout, combine_weights, num_tokens, top_k, send_splits, recv_splits, num_dropped,
        ep_config.num_local_experts,
    )


def ep_expert_compute(
    dispatched: EPDispatched,
    w13_local: torch.Tensor,
    w2_local: torch.Tensor,
    *,
    activation: Activation = Activation.SWIGLU,
    b13_local: torch.Tensor | None = None,
    b2_local: torch.Tensor | None = None,
    align: int = 128,
    stages: RankStages = TORCH_STAGES,
) -> torch.Tensor:
    """Owner side: the received rows are tokens with top_k = 1 over the local experts -> y [N_recv, H].

    Empty rows (local id -1) are off-rank slots for the dispatch (docs/design.md) and come out as zeros.
    Unweighted: the source applies the router weights.
    """
    if not isinstance(dispatched, EPDispatched):
        raise TypeError(f"dispatched: expected ep_dispatch's EPDispatched, got {type(dispatched).__name__}")
    rows, ids = dispatched.recv_rows, dispatched.recv_local_ids
    num_local, _, hidden_size, _ = check_weights(w13_local, w2_local, b13_local, b2_local,
                                                 names=("w13_local", "w2_local", "b13_local", "b2_local"))
    if w13_local.dtype != rows.dtype:
        raise TypeError(f"w13_local: expected dtype {rows.dtype} (the dtype of the received rows, hidden's), got "
                        f"{w13_local.dtype}")
    if w13_local.device != rows.device:
        raise ValueError(f"w13_local: expected a tensor on {rows.device} (the received rows' device), got "
                         f"{w13_local.device}")
    if not _is_int(align) or align < 1:
        raise ValueError(f"align: expected an int >= 1 (rows per expert are padded to a multiple of it), got {align!r}")
    if dispatched.num_local_experts and num_local != dispatched.num_local_experts:
        raise ValueError(f"w13_local: expected this rank's {dispatched.num_local_experts} experts (ep_config), got "
                         f"shape {tuple(w13_local.shape)}")
    if hidden_size != rows.shape[1]:
        raise ValueError(f"w13_local: expected [E_local, 2I, {rows.shape[1]}] (H of the received rows), got shape "
                         f"{tuple(w13_local.shape)}")
    local_disp = stages.dispatch(ids.view(-1, 1), num_local, align=align)
    a1 = stages.gather(rows, local_disp, 1)
    y = stages.grouped_experts(a1, w13_local, w2_local, local_disp, activation, b13_local, b2_local)
    return stages.combine(y, local_disp, None, rows.shape[0], 1, out_dtype=rows.dtype)


def ep_combine(
    y_recv: torch.Tensor,
    dispatched: EPDispatched,
    ep_config: ExpertParallelConfig,
    group=None,
    *,
    out_dtype: torch.dtype | None = None,
    stages: RankStages = TORCH_STAGES,
) -> torch.Tensor:
    """Return expert outputs to their source ranks and combine in fixed slot order (fp32) -> out [T, H]."""
    if not isinstance(dispatched, EPDispatched):
        raise TypeError(f"dispatched: expected ep_dispatch's EPDispatched, got {type(dispatched).__name__}")
    require_tensor("y_recv", y_recv, ndim=2, dtypes=FLOAT_DTYPES)
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {[str(d) for d in FLOAT_DTYPES]} or None, got {out_dtype!r}")
    if y_recv.shape[0] != dispatched.recv_rows.shape[0]:
        raise ValueError(f"y_recv: expected {dispatched.recv_rows.shape[0]} rows (one per received row, "
                         f"ep_expert_compute's output), got shape {tuple(y_recv.shape)}")
    world = ep_config.world_size
    send_layout = dispatched.send_layout
    y_back = torch.empty(send_layout.sorted_slots.shape[0], y_recv.shape[1], dtype=y_recv.dtype, device=y_recv.device)
    # The return trip mirrors the first one: what was received is sent back, split for split (EXACT_SPLITS: into
    # the leading rows; the rest belong to off-rank slots, which combine skips).
    returned = y_back if dispatched.send_splits is None else y_back[:sum(dispatched.send_splits)]
    _all_to_all(returned, y_recv, dispatched.send_splits, dispatched.recv_splits, group, world)
    return stages.combine(
        y_back,
        send_layout,
        dispatched.combine_weights,
        dispatched.num_tokens,
        dispatched.top_k,
        out_dtype=out_dtype or y_recv.dtype,
    )


def _check_inputs(
    hidden, w13_local, w2_local, router_logits, routing, topk_weights, topk_ids, ep_config, b13_local, b2_local,
    e_score_correction_bias, align,
):
    """fused_moe's checks (moe2cta.validation) on this rank's weights and the global expert ids; the values of
    topk_ids only where they are on the CPU (on CUDA reading them would be a device sync, as IdCheck.AUTO)."""
    if not isinstance(ep_config, ExpertParallelConfig):
        raise TypeError(f"ep_config: expected an ExpertParallelConfig, got {type(ep_config).__name__}")
    if not isinstance(routing, RoutingConfig):
        raise TypeError(f"routing: expected a RoutingConfig, got {type(routing).__name__}")
    problem = validate_moe(
        hidden, w13_local, w2_local, router_logits=router_logits, routing=routing, topk_weights=topk_weights,
        topk_ids=topk_ids, b13=b13_local, b2=b2_local, e_score_correction_bias=e_score_correction_bias,
        id_check=IdCheck.CHECK if topk_ids is not None and topk_ids.device.type == "cpu" else IdCheck.SKIP,
        num_global_experts=ep_config.num_global_experts, weight_names=("w13_local", "w2_local", "b13_local", "b2_local"),
    )
    if problem.num_experts != ep_config.num_local_experts:
        raise ValueError(f"w13_local: expected [E_local={ep_config.num_local_experts}, 2I, H] "
                         f"(ep_config.num_local_experts), got {tuple(w13_local.shape)}")
    if not _is_int(align) or align < 1:
        raise ValueError(f"align: expected an int >= 1 (rows per expert are padded to a multiple of it), got {align!r}")


def ep_fused_moe(
    hidden: torch.Tensor,
    w13_local: torch.Tensor,
    w2_local: torch.Tensor,
    router_logits: torch.Tensor | None,
    routing: RoutingConfig,
    ep_config: ExpertParallelConfig,
    group=None,
    *,
    topk_weights: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    activation: Activation = Activation.SWIGLU,
    b13_local: torch.Tensor | None = None,
    b2_local: torch.Tensor | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    router_weight_on: RouterWeightOn = RouterWeightOn.OUTPUT,
    align: int = 128,
    stages: RankStages = TORCH_STAGES,
) -> torch.Tensor:
    """Expert-parallel MoE forward of this rank's tokens -> out [T, H] in hidden.dtype.

    Collective: every rank of `group` (None = the default group) must call it in the same step. Either
    router_logits [T, E_global] (routed here with `routing`) or (topk_weights, topk_ids) with global ids.
    w13_local / w2_local (and biases) are this rank's experts in local-id order (shard_experts).
    """
    _check_inputs(
        hidden, w13_local, w2_local, router_logits, routing, topk_weights, topk_ids, ep_config, b13_local, b2_local,
        e_score_correction_bias, align,
    )
    _check_group(ep_config, group)
    activation = Activation.parse(activation)
    if topk_ids is None:
        routing.check_num_experts(ep_config.num_global_experts)
        topk_weights, topk_ids = stages.route(router_logits, routing, e_score_correction_bias)
    dispatched = ep_dispatch(
        hidden, topk_weights, topk_ids, ep_config, group, router_weight_on=router_weight_on, stages=stages
    )
    y_recv = ep_expert_compute(
        dispatched,
        w13_local,
        w2_local,
        activation=activation,
        b13_local=b13_local,
        b2_local=b2_local,
        align=align,
        stages=stages,
    )
    return ep_combine(y_recv, dispatched, ep_config, group, out_dtype=hidden.dtype, stages=stages)
