"""Dispatch kernels (Triton): topk_ids -> the padded-layout metadata of docs/design.md, on the device only.

Inputs: topk_ids and expert_map int32 or int64 (read as they are, no conversion launch).
Outputs (int32; sizes from T, k, E, align and the tile heights only): counts [E], token_offsets [E+1],
row_offsets [E+1], tile_offsets [len(tile_heights), E+1], sorted_slots [max_rows], slot_rows [T*k].

The permutation is a stable counting sort of the slots s = t*k + j by local expert id. Inside a program the
slots of a block are sorted by the unique key (expert * BLOCK_S + slot-in-block) with tl.sort (bitonic, in
registers); position p of a slot in that order, minus the first position of its expert in the block, is its
rank among the block's slots of that expert, in slot order. No atomics touch the permutation, so it is
deterministic. Off-rank slots (expert_map -> -1, or ids outside [0, E)) use the key E and sort last.

Two schemes, chosen on the host from T*k (static):
  single program (T*k <= AUTO_SINGLE_SLOTS, or up to SINGLE_MAX_SLOTS on request): one launch, one program: histogram (tl.histogram) -> counts ->
    prefix sums (tl.cumsum) -> store offsets; write (row_offsets - token_offsets)[e] to a scratch vector;
    fill sorted_slots with -1; barrier (orders the program's own global stores); sort; scatter.
  multi block: three launches over blocks of BLOCK_S slots:
    1. `block_histogram_kernel`: per-block histograms hist[b, e]; also fills sorted_slots with -1
       (each program a stripe), so the fill is done before launch 3 writes the valid rows;
    2. `scan_kernel` (one program per SCAN_BINS experts): exclusive scan of hist over blocks ->
       prefix[b, e] (rows of expert e in blocks < b) and counts[e];
    3. `place_kernel`: per block: prefix sums of the counts over experts (program 0 stores the offsets),
       the block's histogram -> first position of e in its sorted order; scratch adj[e] = row_offsets[e]
       + prefix[b, e] - that position; barrier; sort; row = p + adj[e]; scatter sorted_slots, slot_rows.

Limits: E <= 512 (histogram bins), T*k < 2**31 / 1024, at most 4 tile heights.
`route_dispatch_fused_kernel` (decode, small T): routing of all tokens + the single-program dispatch in
one launch.
"""
from __future__ import annotations

import functools

import triton.language as tl

from . import routing_triton

__all__ = [
    "jit_functions",
    "SINGLE_MAX_SLOTS",
    "AUTO_SINGLE_SLOTS",
    "multi_block_slots",
    "MAX_TILE_HEIGHTS",
]

SINGLE_MAX_SLOTS = 1024  # most slots one program sorts (DispatchScheme.SINGLE_PROGRAM)
# AUTO: one program up to here. H200: at 1024 slots the single program took 7.2-9.6 us, four blocks of 256
# about 6-7 us (serving_bench/results/router-h200-2026-11-29.md).
AUTO_SINGLE_SLOTS = 512


def multi_block_slots(num_slots: int) -> int:
    """Slots per program of the multi-block scheme: small blocks (short sorts, more programs) up to 32K
    slots, then 512 (H200, E=128, k=8, T=32768: dispatch 19.3 us against 24.1 with 1024 and 43.8 with 2048:
    the sort per program shrinks faster than the scan over blocks grows)."""
    return 256 if num_slots <= 32768 else 512


MAX_TILE_HEIGHTS = 4


def _local_expert_keys(ids_ptr, expert_map_ptr, slots, slot_ok, NUM_EXPERTS: tl.constexpr,
                       NUM_GLOBAL_EXPERTS: tl.constexpr, HAS_MAP: tl.constexpr):
    """Local expert of each slot (int32), or NUM_EXPERTS for off-rank / invalid / past-the-end slots. Ids and map
    entries are int32 or int64, compared in their own type: an int64 value past int32 is off-rank, never wrapped."""
    e = tl.load(ids_ptr + slots, mask=slot_ok, other=-1)
    if HAS_MAP:
        in_range = slot_ok & (e >= 0) & (e < NUM_GLOBAL_EXPERTS)
        e = tl.load(expert_map_ptr + tl.where(in_range, e, 0), mask=in_range, other=-1)
    on_rank = slot_ok & (e >= 0) & (e < NUM_EXPERTS)
    return tl.where(on_rank, e, NUM_EXPERTS).to(tl.int32)


def _store_offsets(counts, counts_ptr, token_offsets_ptr, row_offsets_ptr, tile_offsets_ptr, ecols,
                   NUM_EXPERTS: tl.constexpr, ALIGN: tl.constexpr, NUM_HEIGHTS: tl.constexpr,
                   H0: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr, H3: tl.constexpr):
    """counts [BLOCK] (zero past E) -> store counts and all prefix sums; return (token_incl, row_incl)."""
    e_ok = ecols < NUM_EXPERTS
    tl.store(counts_ptr + ecols, counts, mask=e_ok)
    first = ecols == 0
    token_incl = tl.cumsum(counts, 0)
    tl.store(token_offsets_ptr + ecols + 1, token_incl, mask=e_ok)
    tl.store(token_offsets_ptr + ecols, 0, mask=first)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    row_incl = tl.cumsum(padded, 0)
    tl.store(row_offsets_ptr + ecols + 1, row_incl, mask=e_ok)
    tl.store(row_offsets_ptr + ecols, 0, mask=first)
    stride = NUM_EXPERTS + 1
    if NUM_HEIGHTS > 0:
        tl.store(tile_offsets_ptr + ecols + 1, tl.cumsum((counts + H0 - 1) // H0, 0), mask=e_ok)
        tl.store(tile_offsets_ptr + ecols, 0, mask=first)
    if NUM_HEIGHTS > 1:
        tl.store(tile_offsets_ptr + stride + ecols + 1, tl.cumsum((counts + H1 - 1) // H1, 0), mask=e_ok)
        tl.store(tile_offsets_ptr + stride + ecols, 0, mask=first)
    if NUM_HEIGHTS > 2:
        tl.store(tile_offsets_ptr + 2 * stride + ecols + 1, tl.cumsum((counts + H2 - 1) // H2, 0), mask=e_ok)
        tl.store(tile_offsets_ptr + 2 * stride + ecols, 0, mask=first)
    if NUM_HEIGHTS > 3:
        tl.store(tile_offsets_ptr + 3 * stride + ecols + 1, tl.cumsum((counts + H3 - 1) // H3, 0), mask=e_ok)
        tl.store(tile_offsets_ptr + 3 * stride + ecols, 0, mask=first)
    return token_incl, row_incl


def _fill_minus_one(ptr, start, stop, BLOCK: tl.constexpr):
    """sorted_slots[start:stop] = -1; start a multiple of BLOCK: full blocks unmasked (16-byte stores)."""
    full_stop = start + (stop - start) // BLOCK * BLOCK
    minus_one = tl.full([BLOCK], -1, tl.int32)
    for r0 in range(start, full_stop, BLOCK):
        tl.store(ptr + tl.multiple_of(r0, BLOCK) + tl.arange(0, BLOCK), minus_one)
    offs = full_stop + tl.arange(0, BLOCK)
    tl.store(ptr + offs, minus_one, mask=offs < stop)


def _sort_and_scatter(keys, slot0, num_slots, adj_ptr, sorted_slots_ptr, slot_rows_ptr,
                      NUM_EXPERTS: tl.constexpr, BLOCK_S: tl.constexpr):
    """keys: local expert (or NUM_EXPERTS) of slots slot0 .. slot0+BLOCK_S-1. adj[e]: row of the block's
    first slot of expert e minus that slot's position in the block's sorted order."""
    local = tl.arange(0, BLOCK_S)
    order = tl.sort(keys * BLOCK_S + local)
    expert = order // BLOCK_S
    slot = slot0 + order % BLOCK_S
    valid = expert < NUM_EXPERTS
    row = local + tl.load(adj_ptr + expert, mask=valid, other=0)
    tl.store(sorted_slots_ptr + row, slot, mask=valid)
    tl.store(slot_rows_ptr + slot, tl.where(valid, row, -1), mask=slot < num_slots)


def dispatch_single_program(
    ids_ptr, expert_map_ptr, counts_ptr, token_offsets_ptr, row_offsets_ptr, tile_offsets_ptr,
    sorted_slots_ptr, slot_rows_ptr, scratch_ptr, num_slots, max_rows,
    NUM_EXPERTS: tl.constexpr, NUM_GLOBAL_EXPERTS: tl.constexpr, HAS_MAP: tl.constexpr, ALIGN: tl.constexpr,
    NUM_HEIGHTS: tl.constexpr, H0: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr, H3: tl.constexpr,
    BLOCK_S: tl.constexpr, NUM_BINS: tl.constexpr, FILL_BLOCK: tl.constexpr,
):
    """Whole dispatch of num_slots <= BLOCK_S slots by one program. scratch: >= NUM_BINS int32."""
    slots = tl.arange(0, BLOCK_S)
    keys = _local_expert_keys(ids_ptr, expert_map_ptr, slots, slots < num_slots, NUM_EXPERTS,
                              NUM_GLOBAL_EXPERTS, HAS_MAP)
    ecols = tl.arange(0, NUM_BINS)
    counts = tl.where(ecols < NUM_EXPERTS, tl.histogram(keys, NUM_BINS), 0)
    token_incl, row_incl = _store_offsets(counts, counts_ptr, token_offsets_ptr, row_offsets_ptr,
                                          tile_offsets_ptr, ecols, NUM_EXPERTS, ALIGN, NUM_HEIGHTS,
                                          H0, H1, H2, H3)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    adj = (row_incl - padded) - (token_incl - counts)
    tl.store(scratch_ptr + ecols, adj)
    _fill_minus_one(sorted_slots_ptr, 0, max_rows, FILL_BLOCK)
    tl.debug_barrier()  # scratch and the -1 fill are visible to every thread of the program
    _sort_and_scatter(keys, 0, num_slots, scratch_ptr, sorted_slots_ptr, slot_rows_ptr, NUM_EXPERTS, BLOCK_S)


def dispatch_single_kernel(
    ids_ptr, expert_map_ptr, counts_ptr, token_offsets_ptr, row_offsets_ptr, tile_offsets_ptr,
    sorted_slots_ptr, slot_rows_ptr, scratch_ptr, num_slots, max_rows,
    NUM_EXPERTS: tl.constexpr, NUM_GLOBAL_EXPERTS: tl.constexpr, HAS_MAP: tl.constexpr, ALIGN: tl.constexpr,
    NUM_HEIGHTS: tl.constexpr, H0: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr, H3: tl.constexpr,
    BLOCK_S: tl.constexpr, NUM_BINS: tl.constexpr, FILL_BLOCK: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr = 0,
):
    """Grid: (1,)."""
    if DEPENDENT_LAUNCH >= 1:  # programmatic dependent launch: wait for the previous kernel's results
        tl.extra.cuda.gdc_wait()
    if DEPENDENT_LAUNCH == 2:  # a small launch: the next kernel's grid may start now (else: as blocks exit)
        tl.extra.cuda.gdc_launch_dependents()
    dispatch_single_program(
        ids_ptr, expert_map_ptr, counts_ptr, token_offsets_ptr, row_offsets_ptr, tile_offsets_ptr,
        sorted_slots_ptr, slot_rows_ptr, scratch_ptr, num_slots, max_rows,
        NUM_EXPERTS, NUM_GLOBAL_EXPERTS, HAS_MAP, ALIGN, NUM_HEIGHTS, H0, H1, H2, H3,
        BLOCK_S, NUM_BINS, FILL_BLOCK,
    )


def block_histogram_kernel(
    ids_ptr, expert_map_ptr, hist_ptr, sorted_slots_ptr, num_slots, max_rows, fill_stripe,
    NUM_EXPERTS: tl.constexpr, NUM_GLOBAL_EXPERTS: tl.constexpr, HAS_MAP: tl.constexpr,
    BLOCK_S: tl.constexpr, NUM_BINS: tl.constexpr, FILL_BLOCK: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr = 0,
):
    """Grid: (num_blocks,). hist[b, 0:NUM_BINS] = histogram of block b's local expert keys."""
    if DEPENDENT_LAUNCH >= 1:  # programmatic dependent launch: wait for the previous kernel's results
        tl.extra.cuda.gdc_wait()
    if DEPENDENT_LAUNCH == 2:  # a small launch: the next kernel's grid may start now (else: as blocks exit)
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    slots = b * BLOCK_S + tl.arange(0, BLOCK_S)
    keys = _local_expert_keys(ids_ptr, expert_map_ptr, slots, slots < num_slots, NUM_EXPERTS,
                              NUM_GLOBAL_EXPERTS, HAS_MAP)
    ecols = tl.arange(0, NUM_BINS)
    tl.store(hist_ptr + b * NUM_BINS + ecols, tl.histogram(keys, NUM_BINS))
    start = b * fill_stripe
    stop = tl.maximum(tl.minimum(start + fill_stripe, max_rows), start)
    _fill_minus_one(sorted_slots_ptr, start, stop, FILL_BLOCK)


def scan_kernel(
    hist_ptr, prefix_ptr, counts_ptr, num_blocks,
    NUM_EXPERTS: tl.constexpr, NUM_BINS: tl.constexpr, SCAN_BINS: tl.constexpr, BLOCK_B: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr = 0,
):
    """Grid: (NUM_BINS // SCAN_BINS,). For its experts: prefix[b, e] = sum_{b'<b} hist[b', e]; counts[e]."""
    if DEPENDENT_LAUNCH >= 1:  # programmatic dependent launch: wait for the previous kernel's results
        tl.extra.cuda.gdc_wait()
    if DEPENDENT_LAUNCH == 2:  # a small launch: the next kernel's grid may start now (else: as blocks exit)
        tl.extra.cuda.gdc_launch_dependents()
    ecols = tl.program_id(0) * SCAN_BINS + tl.arange(0, SCAN_BINS)
    bl = tl.arange(0, BLOCK_B)
    carry = tl.zeros([SCAN_BINS], tl.int32)
    for b0 in range(0, num_blocks, BLOCK_B):
        b_ok = (b0 + bl) < num_blocks
        offs = (b0 + bl)[:, None] * NUM_BINS + ecols[None, :]
        h = tl.load(hist_ptr + offs, mask=b_ok[:, None], other=0)
        tl.store(prefix_ptr + offs, carry[None, :] + tl.cumsum(h, axis=0) - h, mask=b_ok[:, None])
        carry += tl.sum(h, axis=0)
    tl.store(counts_ptr + ecols, carry, mask=ecols < NUM_EXPERTS)


def place_kernel(
    ids_ptr, expert_map_ptr, prefix_ptr, counts_ptr, token_offsets_ptr, row_offsets_ptr, tile_offsets_ptr,
    sorted_slots_ptr, slot_rows_ptr, num_slots,
    NUM_EXPERTS: tl.constexpr, NUM_GLOBAL_EXPERTS: tl.constexpr, HAS_MAP: tl.constexpr, ALIGN: tl.constexpr,
    NUM_HEIGHTS: tl.constexpr, H0: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr, H3: tl.constexpr,
    BLOCK_S: tl.constexpr, NUM_BINS: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr = 0,
):
    """Grid: (num_blocks,). Offsets from the counts (program 0 stores them); stable rank inside the block by
    sorting; row = row_offsets[e] + rows of e in earlier blocks + rank. prefix[b, :] is reused as the
    block's scratch vector of per-expert row adjustments."""
    if DEPENDENT_LAUNCH >= 1:  # programmatic dependent launch: wait for the previous kernel's results
        tl.extra.cuda.gdc_wait()
    if DEPENDENT_LAUNCH == 2:  # a small launch: the next kernel's grid may start now (else: as blocks exit)
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    slot0 = b * BLOCK_S
    slots = slot0 + tl.arange(0, BLOCK_S)
    keys = _local_expert_keys(ids_ptr, expert_map_ptr, slots, slots < num_slots, NUM_EXPERTS,
                              NUM_GLOBAL_EXPERTS, HAS_MAP)
    ecols = tl.arange(0, NUM_BINS)
    counts = tl.load(counts_ptr + ecols, mask=ecols < NUM_EXPERTS, other=0)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    row_first = tl.cumsum(padded, 0) - padded
    if b == 0:
        _store_offsets(counts, counts_ptr, token_offsets_ptr, row_offsets_ptr, tile_offsets_ptr, ecols,
                       NUM_EXPERTS, ALIGN, NUM_HEIGHTS, H0, H1, H2, H3)
    hist = tl.histogram(keys, NUM_BINS)
    first_in_block = tl.cumsum(hist, 0) - hist
    scratch = prefix_ptr + b * NUM_BINS + ecols
    tl.store(scratch, row_first + tl.load(scratch) - first_in_block)
    tl.debug_barrier()  # the adjustments are read back by other threads of this program
    _sort_and_scatter(keys, slot0, num_slots, prefix_ptr + b * NUM_BINS, sorted_slots_ptr, slot_rows_ptr,
                      NUM_EXPERTS, BLOCK_S)


def route_dispatch_fused_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, stride_logits, routed_scaling_factor,
    expert_map_ptr, counts_ptr, token_offsets_ptr, row_offsets_ptr, tile_offsets_ptr,
    sorted_slots_ptr, slot_rows_ptr, scratch_ptr, num_slots, max_rows,
    R_NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, SCORING: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, USE_LIBDEVICE: tl.constexpr,
    NUM_EXPERTS: tl.constexpr, NUM_GLOBAL_EXPERTS: tl.constexpr, HAS_MAP: tl.constexpr, ALIGN: tl.constexpr,
    NUM_HEIGHTS: tl.constexpr, H0: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr, H3: tl.constexpr,
    BLOCK_S: tl.constexpr, NUM_BINS: tl.constexpr, FILL_BLOCK: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr = 0,
):
    """Grid: (1,). Small T (decode): route every token, barrier, then the single-program dispatch, in one
    launch. R_NUM_EXPERTS: experts in the logits (global); NUM_EXPERTS: local experts of the dispatch."""
    if DEPENDENT_LAUNCH >= 1:  # programmatic dependent launch: wait for the previous kernel's results
        tl.extra.cuda.gdc_wait()
    if DEPENDENT_LAUNCH == 2:  # a small launch: the next kernel's grid may start now (else: as blocks exit)
        tl.extra.cuda.gdc_launch_dependents()
    for tok0 in range(0, num_tokens, BLOCK_T):
        route_token_block(
            logits_ptr, bias_ptr, weights_ptr, ids_ptr, tok0, num_tokens, stride_logits, routed_scaling_factor,
            R_NUM_EXPERTS, TOP_K, SCORING, RENORMALIZE, HAS_BIAS, NUM_GROUPS, TOPK_GROUP,
            BLOCK_T, BLOCK_E, BLOCK_K, BLOCK_G, USE_LIBDEVICE,
        )
    tl.debug_barrier()  # the ids stored above are read back by other threads of this program
    dispatch_single_program(
        ids_ptr, expert_map_ptr, counts_ptr, token_offsets_ptr, row_offsets_ptr, tile_offsets_ptr,
        sorted_slots_ptr, slot_rows_ptr, scratch_ptr, num_slots, max_rows,
        NUM_EXPERTS, NUM_GLOBAL_EXPERTS, HAS_MAP, ALIGN, NUM_HEIGHTS, H0, H1, H2, H3,
        BLOCK_S, NUM_BINS, FILL_BLOCK,
    )


_JIT_NAMES = (
    "_local_expert_keys", "_store_offsets", "_fill_minus_one", "_sort_and_scatter", "dispatch_single_program",
    "dispatch_single_kernel", "block_histogram_kernel", "scan_kernel", "place_kernel", "route_dispatch_fused_kernel",
)


@functools.lru_cache(maxsize=2)
def _jit_functions(interpret: bool):
    del interpret  # cache key only
    return routing_triton.build_jit_namespace(globals(), _JIT_NAMES, extra=(routing_triton.jit_functions(),))


def jit_functions():
    """The dispatch kernels (and the fused route + dispatch kernel) for the current interpreter mode."""
    return _jit_functions(routing_triton.triton_interpreting())
