"""Hopper (sm_90a) persistent grouped GEMM over experts in CuTe DSL: the kernel and its compile glue.

This module imports `cutlass` at the top: import it lazily (sm90_grouped_gemm.py does), never from a
package __init__. The epilogue's math and stores are in cute_epilogue.py (a mixin of this kernel class); the
PaddingRows.FUSE_TAIL variant, whose expert tails ride on the m-block before them, is cute_fused_tail_backend.py.

Problem: for every expert e, the rows [row_offsets[e], row_offsets[e+1]) of A [M, K] (K-major, padded
expert order) times B[e] [N, K] (K-major), fp32 accumulation, fused epilogue, output C [M, N_out] in A's
dtype. One launch covers all experts; which tiles exist is decided on the device from row_offsets and
counts (no host sync, CUDA-graph capturable). M is symbolic: one compiled kernel serves every batch.

A comes from one of two places (a_source): A_COPY, the gathered copy [M, K] in padded expert order; or
A_TOKEN_ROWS (GEMM1, SINGLE units, COOPERATIVE), the token matrix [T, K] itself, where padded row r reads token
a_rows[r] // rows_per_token (a_rows = the dispatch's sorted_slots; a padding row, -1, reads token r % T: a real
row's values, and no row that every CTA reads at once).

Warp roles (one CTA, 128 threads per warpgroup):
- warpgroup 0, warp 0: TMA producer. For each work unit it walks the K tiles and issues one TMA load of
  the CTA's A tile and one of the B tile into the next free stage of the mainloop pipeline.
  A_TOKEN_ROWS: all four warps of warpgroup 0 produce. At each unit every thread reads the tokens of its 8
  rows (thread t: rows t // 8 + 16 i); per stage it waits for the stage to be empty, copies chunk t % 8 (16
  bytes) of each of its rows' 64-column slices by cp.async into the swizzled stage, and arrives on the stage's
  full barrier when those copies landed (cp.async.mbarrier.arrive.noinc). Warp 0 also sets B's transaction
  bytes and loads B by TMA. (One 1-row TMA box per row instead was measured 1.7-3x slower: 128 TMA issues
  per stage.)
- consumer warpgroups 1..W, wgmma. COOPERATIVE (W = tile_m / 64): each owns 64 rows of every tile.
  PINGPONG (W = 2; validated on the H200, not the default: at most 128x128 per warpgroup, which loses
  to COOPERATIVE 128x256): each takes every other unit whole, so one warpgroup's epilogue runs under
  the other's mainloop; an ordering barrier keeps the two mainloops in unit order (parity waits on a
  shared pipeline must never run two phases ahead).
  A consumer waits for a full stage, issues wgmma, releases the stage once the next wgmma group
  retired, then runs the epilogue: bias / gated activation / row scale in registers, stmatrix to a
  staged SMEM buffer, one TMA store per epilogue sub-tile by one warp of the warpgroup.
  epilogue_store UNDER_NEXT_MAINLOOP (COOPERATIVE): the tile is converted to C's dtype and held in registers
  (GEMM2 128x256: 64 registers beside the 128 of the accumulator), and the next unit's first K tiles each
  store one of its sub-tiles between their wgmma commit and wait, so the stores run under the MMAs (sub-tiles
  beyond the unit's K tiles follow its mainloop; the last unit's tile is stored after the loop).
  epilogue_store ACTIVATION_UNDER_NEXT_MAINLOOP (GEMM1): what is held is each output's gate and up (bias added,
  rounded to C's dtype as a same-dtype torch run rounds its GEMM output) in one 32-bit word, 64 registers for
  128x256, and each sub-tile's activation runs with its store under the next unit's K tiles. (The bf16 halves are
  unpacked by shift and mask: converting 16-bit elements of a loop-carried tensor made ptxas spill.) COOPERATIVE
  fences (wgmma.fence) before each K tile's MMAs: where ptxas has to insert that fence itself on a
  divergent path, it serializes every wgmma (it did in the PAIR kernels; tests/test_sm90_compile.py runs
  ptxas to check).
  padding_rows SKIP (COOPERATIVE): a warpgroup whose 64 rows of the tile are all padding (an expert's last
  m-block with at most 64 valid rows) only waits on and releases each stage, so the other warpgroup has
  the tensor cores to itself; its accumulator stays 0 and its rows are stored like any padding row.
Pipelines:
- mainloop (PipelineTmaAsync, `stages` deep): "full" = the stage's A and B bytes landed (transaction
  count; A_TOKEN_ROWS: B's bytes and 128 more arrivals, one per producer thread whose copies landed), "empty" =
  every consumer warp of every CTA that reads this stage's B (both CTAs of a cluster, since B may be
  multicast into both) is done with it.
- scheduler (PipelineAsync, 2 slots, DYNAMIC only): "full" = the producer wrote the next unit id into
  the SMEM slot, "empty" = every consumer thread read it (A_TOKEN_ROWS: and every producer thread). Clusters of 2: rank 0's producer also stores the
  unit into rank 1's slot (st.async.shared::cluster, completing rank 1's "full" barrier by its 4 bytes,
  which rank 1's producer expects), and "empty" lives in rank 0 only: every reader of both CTAs (the
  consumer threads of both, and rank 1's producer) arrives there.
- epilogue store (PipelineTmaStore): bulk-group accounting, so an SMEM epilogue buffer is reused only
  after the TMA store that reads it finished.
While the consumers run the epilogue of unit i, the producer already streams unit i+1's first stages; with
UNDER_NEXT_MAINLOOP the tensor cores wait only for the epilogue math (the activation's sigmoid takes an
approximate reciprocal: an IEEE division per output cost a third of GEMM1's time at qwen3-30b-a3b T=8192), and
with ACTIVATION_UNDER_NEXT_MAINLOOP only for the bias and the conversion to 16 bits.

Work units and clusters: cluster (cluster_m, 1, 1), cluster_m 1 or 2. Global m-blocks (row / tile_m over
all experts) are taken cluster_m at a time: unit u covers m-blocks cluster_m * mu + rank at n-block nb
(raster ALONG_M: mu fastest; ALONG_N: nb fastest; GROUPED_M: mu fastest within groups of
raster_group_m m-units, then nb, then the next group; EXPERT_GROUPED_M, cluster_m 1: the same with groups cut
from each expert's m-blocks, so that no group spans two experts: expert e's units are the n_blocks *
m_blocks(e) that follow those of experts < e, and all of its m-blocks in a group read one weight tile back to
back). With cluster_m == 2 the unit is a PAIR when both
m-blocks belong to one expert with counts[e] >= pair_threshold (a runtime argument): each CTA loads half
of the weight tile and multicasts it to both (.multicast::cluster). Otherwise the two CTAs work as two
SINGLES (possibly of different experts), each loading its own whole weight tile. Both CTAs decode the
same unit from the same metadata, so their pipelines stay in lockstep. With cluster_m 2, m-blocks that hold
only padding rows are computed but not stored, and so is an m-block past the last expert (the second CTA of a
cluster when the m-block count is odd), to keep the pair in lockstep. With cluster_m 1 (COOPERATIVE) such a unit
is skipped: neither the producer nor the consumers touch a stage for it. That is what lets one launch multiply a
subset of the experts, the others given 0 rows by `counts` while row_offsets keeps their rows (the layer's expert
classes, sm90_grouped_gemm.expert_classes): their m-blocks cost a unit fetch each, not a weight pass.
The per-unit expert search (binary search over row_offsets) reads SMEM copies made at kernel start.

Grid: persistent, one CTA per SM (a CTA takes a whole SM's SMEM). The CTA count is a launch argument (num_ctas,
the device's SMs in whole clusters: sm90_grouped_gemm.persistent_ctas), not a compile-time fact, and the kernels
read it back from the grid, so one compiled kernel fits every Hopper part.

Schedulers: STATIC (unit = cluster id + i * clusters) or DYNAMIC (the producer's lane 0 of each cluster's
rank 0 takes units from a global atomic counter one unit ahead and hands them to the consumers, and to
rank 1, through the scheduler pipeline; both CTAs of a cluster so always work on the same unit), or DYNAMIC_SIDES
(DYNAMIC with the unit order cut in halves, one per L2 partition: a cluster takes units of its SM's half first, so
the units that share a tile run on SMs of one partition; l2_sides.py). The
host wrapper (sm90_grouped_gemm._launch_scratch) zeroes a fresh workspace for every launch in stream order, so
no state outlives a launch or a graph replay; in the kernel, every fetching CTA adds one to a finish count after
its last fetch, and the last one to finish zeroes the counter words again (callers that pass one workspace to several
launches must keep them stream-ordered).

Launch (dependent_launch): LAUNCH_STREAM_ORDER, a plain launch; LAUNCH_PROGRAMMATIC, a programmatic dependent launch
(sm_90): the CTAs may become resident while the previous kernel of the stream drains (as its CTAs free their SMs),
build their barriers and prefetch their TMA descriptors, then every thread waits (griddepcontrol.wait: the previous
kernel completed and its writes are visible) before the first read of any input, and the CTA releases the next
kernel's launch (griddepcontrol.launch_dependents); LAUNCH_PROGRAMMATIC_WEIGHT_PREFETCH also has the producer warp
prefetch the first `stages` K tiles of its first unit's weight tile into L2 before the wait (cp.async.bulk.prefetch,
one elected lane), the unit decoded from SMEM copies of the metadata made before the wait (a guess where a caller's
previous kernel still writes them: it costs only that prefetch, and the copies are made again after the wait).

Limits: bf16/fp16, K-major A and B, K % 8 == 0 (TMA zero-fills a partial last K tile; A_TOKEN_ROWS: K % tile_k
== 0, tile_k a multiple of 64, and every a_rows entry below T * rows_per_token), N a multiple of 16 (GEMM1) or 8
(GEMM2) where no tile_n divides it (a partial last n-block: TMA zero-fills B's missing rows, the bias index is
clamped, the C store clips; sm90_config.N_TAIL_ALIGN), row_offsets multiples of tile_m, at most 256 experts; GEMM1 weights prepacked (gate/up rows
interleaved in chunks of 8, matching the wgmma accumulator's 8-column groups).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

# epilogue kinds (strings so they are static and hashable) and the epilogue's helpers
from .cute_epilogue import GATED_EPILOGUES, Sm90EpilogueMixin

SCHED_STATIC = "static"
SCHED_DYNAMIC = "dynamic"
# DYNAMIC with the unit order cut in two halves, one per L2 partition ("side"): workspace[4 + smid] is the side of
# that SM (grouped_gemm/l2_sides.py), workspace[0] / [2] count the units taken from the first / second half
SCHED_DYNAMIC_SIDES = "dynamic_sides"
SIDE_MAP_OFFSET = 4
SIDE_MAP_ENTRIES = 256  # SM ids below 256 (an H100 / H200 has 132 SMs numbered up to 143)
RASTER_M = "along_m"  # consecutive units walk down the m-blocks of one n-block (weight tile reuse in L2)
RASTER_N = "along_n"  # consecutive units walk across the n-blocks of one m-block (A tile reuse in L2)
RASTER_GROUPED_M = "grouped_m"  # groups of raster_group_m m-blocks: m-blocks of a group, then the next n-block
RASTER_EXPERT_GROUPED_M = "expert_grouped_m"  # GROUPED_M with groups cut at expert boundaries (cluster_m 1)
CONSUMERS_COOPERATIVE = "cooperative"  # the consumer warpgroups split the rows of every tile
STORE_AFTER_MAINLOOP = "after_mainloop"  # epilogue_store values (sm90_grouped_gemm.EpilogueStore)
STORE_UNDER_NEXT_MAINLOOP = "under_next_mainloop"
STORE_ACTIVATION_UNDER_NEXT_MAINLOOP = "activation_under_next_mainloop"  # gated: the activation math goes under too
CONSUMERS_PINGPONG = "pingpong"  # two consumer warpgroups take alternate units (epilogue under the other's MMA)
PADDING_MULTIPLY = "multiply"  # a consumer warpgroup whose 64 rows are all padding runs its MMAs anyway
PADDING_SKIP = "skip"  # ... only waits on and releases the stages (COOPERATIVE 128-row tiles)
A_COPY = "copy"  # A is the gathered copy [M, K] in padded expert order, loaded by TMA
# A is the token matrix [T, K]; row r reads token a_rows[r] // rows_per_token (padding: r % T) by cp.async
A_TOKEN_ROWS = "token_rows"
CP_ASYNC_CHUNK = 8  # elements per 16-byte cp.async (bf16 / fp16)
# dependent_launch values (sm90_grouped_gemm.DependentLaunch)
LAUNCH_STREAM_ORDER = "stream_order"
LAUNCH_PROGRAMMATIC = "programmatic"  # griddepcontrol.wait before the first input read, then launch_dependents
LAUNCH_PROGRAMMATIC_WEIGHT_PREFETCH = "programmatic_weight_prefetch"  # ... and the first weight tiles into L2 before


class Sm90GroupedGemmKernel(Sm90EpilogueMixin):
    """One compiled instance = one static configuration (see the module docstring)."""

    def __init__(
        self,
        *,
        tile_m: int,
        tile_n: int,
        tile_k: int,
        stages: int,
        cluster_m: int,
        epilogue: str,
        has_bias: bool,
        has_row_scale: bool,
        num_experts: int,
        scheduler: str,
        raster: str,
        consumers: str = CONSUMERS_COOPERATIVE,
        raster_group_m: int = 8,
        padding_rows: str = PADDING_MULTIPLY,
        a_source: str = A_COPY,
        epilogue_store: str = STORE_AFTER_MAINLOOP,
        dependent_launch: str = LAUNCH_STREAM_ORDER,
    ):
        self.tile_m, self.tile_n, self.tile_k = tile_m, tile_n, tile_k
        self.programmatic = dependent_launch != LAUNCH_STREAM_ORDER
        self.weight_prefetch = dependent_launch == LAUNCH_PROGRAMMATIC_WEIGHT_PREFETCH
        self.token_rows = a_source == A_TOKEN_ROWS
        self.store_under_next = epilogue_store in (STORE_UNDER_NEXT_MAINLOOP, STORE_ACTIVATION_UNDER_NEXT_MAINLOOP)
        self.pingpong = consumers == CONSUMERS_PINGPONG
        self.skip_padding = padding_rows == PADDING_SKIP
        # a unit whose tile holds no valid row of its expert (an expert given 0 rows by its counts, as the layer's
        # expert classes give the other classes' experts) loads and multiplies nothing; one CTA per unit only
        self.skip_empty_units = cluster_m == 1 and consumers != CONSUMERS_PINGPONG
        self.stages = stages
        self.cluster_m = cluster_m
        self.epilogue = epilogue
        self.gated = epilogue in GATED_EPILOGUES
        self.activation_under_next = epilogue_store == STORE_ACTIVATION_UNDER_NEXT_MAINLOOP and self.gated
        self.has_bias = has_bias
        self.has_row_scale = has_row_scale
        self.num_experts = num_experts
        self.scheduler = scheduler
        self.dynamic = scheduler in (SCHED_DYNAMIC, SCHED_DYNAMIC_SIDES)  # units from a global atomic counter
        self.sides = scheduler == SCHED_DYNAMIC_SIDES
        self.raster = raster
        self.raster_group_m = raster_group_m
        self.out_tile_n = tile_n // 2 if self.gated else tile_n
        self.num_consumer_wg = 2 if self.pingpong else tile_m // 64
        self.mma_wg = 1 if self.pingpong else self.num_consumer_wg  # warpgroups sharing one tile's MMA
        self.threads_per_wg = 128
        self.threads = (1 + self.num_consumer_wg) * self.threads_per_wg
        self.num_consumer_threads = self.num_consumer_wg * self.threads_per_wg
        self.acc_dtype = cutlass.Float32
        self.epi_stages = 2  # per epilogue-running warpgroup
        self.sched_stages = 2
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_consumer_threads)
        self.buffer_align_bytes = 1024

    # ------------------------------------------------------------------ host side (trace time)
    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # [M, K]
        b: cute.Tensor,  # [E, N, K]
        c: cute.Tensor,  # [M, N_out]
        row_offsets: cute.Tensor,  # [E+1] int32
        counts: cute.Tensor,  # [E] int32
        bias: cute.Tensor,  # [E, N] fp32 (packed like b for gated epilogues); unused unless has_bias
        row_scale: cute.Tensor,  # [M] fp32; unused unless has_row_scale
        workspace: cute.Tensor,  # [4] int32: dynamic scheduler counter, done count (DYNAMIC_SIDES: + side map)
        pair_threshold: cutlass.Int32,
        num_ctas: cutlass.Int32,  # the persistent grid: the device's SMs (a multiple of cluster_m)
        stream,
    ):
        """A_COPY: A is the gathered copy in padded expert order."""
        self.launch(a, row_offsets, cutlass.Int32(1), b, c, row_offsets, counts, bias, row_scale, workspace,
                    pair_threshold, num_ctas, stream)

    @cute.jit
    def call_token_rows(
        self,
        a: cute.Tensor,  # [T, K]: the token rows
        a_rows: cute.Tensor,  # [M] int32: padded row -> slot t * rows_per_token + j (-1: padding, reads token row % T)
        b: cute.Tensor,
        c: cute.Tensor,  # [M, N_out]
        row_offsets: cute.Tensor,
        counts: cute.Tensor,
        bias: cute.Tensor,
        row_scale: cute.Tensor,
        workspace: cute.Tensor,
        pair_threshold: cutlass.Int32,
        rows_per_token: cutlass.Int32,  # top-k: slot // rows_per_token is the token
        num_ctas: cutlass.Int32,
        stream,
    ):
        """A_TOKEN_ROWS: GEMM1 reads the token rows itself (no gathered copy of A)."""
        self.launch(a, a_rows, rows_per_token, b, c, row_offsets, counts, bias, row_scale, workspace, pair_threshold,
                    num_ctas, stream)

    @cute.jit
    def launch(self, a, a_rows, rows_per_token, b, c, row_offsets, counts, bias, row_scale, workspace, pair_threshold,
               num_ctas, stream):
        """Trace-time set-up (MMA atoms, SMEM layouts, copy atoms, shared storage) and the launch."""
        self.ab_dtype = a.element_type
        self.n = b.shape[1]
        self.n_blocks = (self.n + self.tile_n - 1) // self.tile_n  # a partial last n-block: TMA zero-fills / clips
        self.c_dtype = c.element_type
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype,
            (self.mma_wg, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        # the same instruction shape over the output columns: its C partition is the epilogue's layout
        self.out_tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype,
            (self.mma_wg, 1, 1),
            tiler_mn=(64, self.out_tile_n),
        )
        tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        self.epi_tile = (self.tile_m, min(32, self.out_tile_n)) if self.mma_wg > 1 else (64, min(32, self.out_tile_n))
        a_layout = LayoutEnum.from_tensor(a)
        c_layout = LayoutEnum.from_tensor(c)
        self.c_layout = c_layout
        a_smem_staged = sm90_utils.make_smem_layout_a(a_layout, tile_mnk, self.ab_dtype, self.stages)
        b_smem_staged = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_mnk, self.ab_dtype, self.stages)
        epi_buffers = self.epi_stages * (2 if self.pingpong else 1)  # pingpong: one set per warpgroup
        epi_smem_staged = sm90_utils.make_smem_layout_epi(self.c_dtype, c_layout, self.epi_tile, epi_buffers)

        # B viewed as (N, K, E) so that the expert is the batch mode of the TMA tensor
        b_nke = cute.make_tensor(b.iterator, cute.select(b.layout, mode=[1, 2, 0]))

        a_smem_one = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem_one = cute.slice_(b_smem_staged, (None, None, 0))
        if cutlass.const_expr(self.token_rows):
            # 16-byte cp.async per thread; the producer warpgroup's 128 threads cover 16 rows x 8 chunks of 8
            # elements per copy (tile_k 64: one 128-byte row slice per 8 threads, coalesced)
            tma_atom_a = cute.make_copy_atom(
                cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                self.ab_dtype,
                num_bits_per_copy=128,
            )
            tma_a = a
        else:
            tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), a, a_smem_one, (self.tile_m, self.tile_k)
            )
        tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), b_nke, b_smem_one, (self.tile_n, self.tile_k)
        )
        tma_atom_b_mc, tma_b_mc = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if cutlass.const_expr(self.cluster_m > 1)
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            b_nke,
            b_smem_one,
            (self.tile_n, self.tile_k),
            num_multicast=self.cluster_m,
        )
        tma_atom_c, tma_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            c,
            cute.slice_(epi_smem_staged, (None, None, 0)),
            self.epi_tile,
        )
        self.tma_bytes = cute.size_in_bytes(self.ab_dtype, b_smem_one)
        if cutlass.const_expr(not self.token_rows):
            self.tma_bytes += cute.size_in_bytes(self.ab_dtype, a_smem_one)

        self.shared_storage = self.make_shared_storage(a_smem_staged, b_smem_staged, epi_smem_staged)
        self.kernel(
            tma_atom_a,
            tma_a,
            tma_atom_b,
            tma_b,
            tma_atom_b_mc,
            tma_b_mc,
            tma_atom_c,
            tma_c,
            a_rows,
            rows_per_token,
            row_offsets,
            counts,
            bias,
            row_scale,
            workspace,
            pair_threshold,
            a_smem_staged,
            b_smem_staged,
            epi_smem_staged,
            self.tiled_mma,
            self.out_tiled_mma,
        ).launch(
            grid=(num_ctas, 1, 1),
            block=(self.threads, 1, 1),
            cluster=(self.cluster_m, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.programmatic,
        )

    def make_shared_storage(self, a_staged, b_staged, epi_staged):
        """The CTA's shared storage (trace time): mainloop and scheduler barriers, the scheduler's unit slots, the SMEM
        copy of the dispatch metadata, then the A, B and epilogue buffers of these staged layouts, 1 KiB aligned."""

        mem, align = cute.struct.MemRange, cute.struct.Align
        fields = {  # (field annotations as objects: this module's annotations are strings)
            "mainloop_barriers": mem[cutlass.Int64, self.stages * 2],
            "sched_barriers": mem[cutlass.Int64, self.sched_stages * 2],
            "sched_slots": mem[cutlass.Int32, self.sched_stages * 4],
            "expert_rows": mem[cutlass.Int32, self.num_experts + 1],
            "expert_counts": mem[cutlass.Int32, self.num_experts],
            "sA": align[mem[self.ab_dtype, cute.cosize(a_staged)], self.buffer_align_bytes],
            "sB": align[mem[self.ab_dtype, cute.cosize(b_staged)], self.buffer_align_bytes],
            "sC": align[mem[self.c_dtype, cute.cosize(epi_staged)], self.buffer_align_bytes],
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def single_cta_pipelines(self, storage, tx_count, copying_threads=0):
        """The pipelines of a cluster-1 kernel (cute_swapped_backend.py, cute_fused_tail_backend.py), then the
        barrier-init arrive: the mainloop's (one TMA producer thread, `tx_count` bytes a stage, every consumer warp
        releases) and the DYNAMIC scheduler's (one producer thread, every consumer thread reads each slot).
        `copying_threads` producer threads that also fill each stage by cp.async (one .noinc arrival each on "full")
        and read every published unit (A_TOKEN_ROWS)."""
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mainloop_barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + copying_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_consumer_wg),
            tx_count=tx_count,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        sched = pipeline.PipelineAsync.create(
            barrier_storage=storage.sched_barriers.data_ptr(),
            num_stages=self.sched_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads + copying_threads),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        return mainloop, sched

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def copy_metadata(self, storage, row_offsets, counts, tidx):
        """SMEM copies of row_offsets and counts, written by all threads (the per-unit expert search then costs SMEM,
        not L2, latency); the caller synchronizes the CTA before reading them."""
        s_rows = storage.expert_rows.get_tensor(cute.make_layout(self.num_experts + 1))
        s_counts = storage.expert_counts.get_tensor(cute.make_layout(self.num_experts))
        for i in cutlass.range(tidx, self.num_experts + 1, self.threads, unroll=1):
            s_rows[i] = row_offsets[i]
            if i < self.num_experts:
                s_counts[i] = counts[i]
        return s_rows, s_counts

    @cute.jit
    def await_previous_kernel(self):
        """DependentLaunch PROGRAMMATIC*: wait until the previous kernel of the stream completed and its writes are
        visible (griddepcontrol.wait; every thread, before its first read of an input), then release the next
        kernel's launch (its CTAs take the SMs that this kernel's CTAs leave). A plain launch: nothing."""
        if cutlass.const_expr(self.programmatic):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def prefetch_weight_tiles(self, tma_atom: cute.CopyAtom, tBgB: cute.Tensor, nb, expert, k_tiles):
        """Producer warp: the first `stages` K tiles of one weight tile into L2 (cp.async.bulk.prefetch.tensor, the
        boxes the mainloop's TMA loads will read)."""
        with cute.arch.elect_one():  # (cute.prefetch is issued by every thread that runs it; cute.copy elects)
            for k in cutlass.range(cutlass.min(k_tiles, cutlass.Int32(self.stages)), unroll=1):
                cute.prefetch(tma_atom, tBgB[(None, nb, k, expert)])

    @cute.jit
    def expert_of_row(self, row_offsets: cute.Tensor, row: cutlass.Int32) -> cutlass.Int32:
        """Largest e < E with row_offsets[e] <= row (unrolled binary search; empty experts are skipped)."""
        lo = cutlass.Int32(0)
        step = 1 << (max(self.num_experts - 1, 1).bit_length() - 1)
        while cutlass.const_expr(step >= 1):
            cand = lo + step
            safe = cutlass.min(cand, cutlass.Int32(self.num_experts - 1))
            if cand < self.num_experts and row_offsets[safe] <= row:
                lo = safe
            step //= 2
        return lo

    @cute.jit
    def decode_unit(self, unit: cutlass.Int32, row_offsets, counts, pair_threshold, rank: cutlass.Int32):
        """unit -> (m_block of this CTA, n_block, expert, tile has rows, tile has valid rows, is pair).

        `tile has rows`: the m-block lies inside rows in use (else: compute nothing useful, store nothing).
        """
        total_rows = row_offsets[self.num_experts]
        num_m_blocks = total_rows // self.tile_m
        num_m_units = (num_m_blocks + self.cluster_m - 1) // self.cluster_m
        num_n_blocks = self.n_blocks
        mu = unit % num_m_units
        nb = unit // num_m_units
        if cutlass.const_expr(self.raster == RASTER_N):
            nb = unit % num_n_blocks
            mu = unit // num_n_blocks
        elif cutlass.const_expr(self.raster == RASTER_GROUPED_M):
            span = self.raster_group_m * num_n_blocks
            group = unit // span
            first = group * self.raster_group_m
            size = cutlass.min(cutlass.Int32(self.raster_group_m), num_m_units - first)  # the last group may be short
            within = unit - group * span
            mu = first + within % size
            nb = within // size
        elif cutlass.const_expr(self.raster == RASTER_EXPERT_GROUPED_M):
            # expert e's units start at n_blocks * (its first m-block): the unit's m-block "row" unit // n_blocks
            # lies inside e's m-blocks, so the usual search finds e
            owner = self.expert_of_row(row_offsets, cutlass.min(unit // num_n_blocks, num_m_blocks - 1) * self.tile_m)
            first_block = row_offsets[owner] // self.tile_m
            expert_blocks = row_offsets[owner + 1] // self.tile_m - first_block
            span = self.raster_group_m * num_n_blocks
            local = unit - first_block * num_n_blocks
            group = local // span
            first = group * self.raster_group_m
            size = cutlass.max(cutlass.min(cutlass.Int32(self.raster_group_m), expert_blocks - first), 1)
            within = local - group * span
            mu = first_block + first + within % size
            nb = within // size
        m_block = mu * self.cluster_m + rank
        in_use = m_block < num_m_blocks
        row = cutlass.min(m_block, num_m_blocks - 1) * self.tile_m
        expert = self.expert_of_row(row_offsets, row)
        has_valid = in_use and (m_block * self.tile_m - row_offsets[expert]) < counts[expert]
        is_pair = cutlass.Boolean(False)
        if cutlass.const_expr(self.cluster_m == 2):
            first = mu * 2
            second = first + 1
            e0 = self.expert_of_row(row_offsets, first * self.tile_m)
            e1 = self.expert_of_row(row_offsets, cutlass.min(second, num_m_blocks - 1) * self.tile_m)
            is_pair = second < num_m_blocks and e0 == e1 and counts[e0] >= pair_threshold
        return m_block, nb, expert, in_use, has_valid, is_pair

    @cute.jit
    def total_units(self, row_offsets) -> cutlass.Int32:
        num_m_blocks = row_offsets[self.num_experts] // self.tile_m
        return ((num_m_blocks + self.cluster_m - 1) // self.cluster_m) * self.n_blocks

    # ------------------------------------------------------------------ the kernel
    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_b_mc: cute.CopyAtom,
        mB_mc: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC: cute.Tensor,
        a_rows: cute.Tensor,
        rows_per_token: cutlass.Int32,
        row_offsets: cute.Tensor,
        counts: cute.Tensor,
        bias: cute.Tensor,
        row_scale: cute.Tensor,
        workspace: cute.Tensor,
        pair_threshold: cutlass.Int32,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        out_tiled_mma: cute.TiledMma,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        if warp_idx == 0:
            if cutlass.const_expr(not self.token_rows):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b_mc)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_c)

        rank = cutlass.Int32(0)
        if cutlass.const_expr(self.cluster_m > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_id = bidx // self.cluster_m
        num_clusters = gdim // self.cluster_m

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        cta_layout_vmnk = cute.make_layout((1, self.cluster_m, 1, 1))
        num_consumer_warps = self.num_consumer_wg * 4
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mainloop_barriers.data_ptr(),
            num_stages=self.stages,
            # "full": the TMA thread's arrival (with B's transaction bytes, and A's with A_COPY); A_TOKEN_ROWS:
            # also one arrival per producer thread when its cp.async copies of the stage landed (.noinc)
            producer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 1 + (self.threads_per_wg if self.token_rows else 0)
            ),
            # every warp that reads a stage releases it in every CTA of the cluster (pingpong: one warpgroup)
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cluster_m * self.mma_wg * 4),
            tx_count=self.tma_bytes,
            cta_layout_vmnk=cta_layout_vmnk,
            defer_sync=True,
        )
        # dynamic scheduler: the producer warp's lane 0 writes the fetched unit into an SMEM slot ("full"
        # = slot written, one arrival); every consumer thread reads it and arrives on "empty"
        # cluster of 2: rank 0's "empty" counts the readers of both CTAs (+ rank 1's producer lane), and every
        # reader releases there (consumer_mask = destination rank 0)
        sched = pipeline.PipelineAsync.create(
            barrier_storage=storage.sched_barriers.data_ptr(),
            num_stages=self.sched_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # A_TOKEN_ROWS: the four producer warps read every unit too
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread,
                self.cluster_m * self.num_consumer_threads + self.cluster_m - 1
                + (self.threads_per_wg if self.token_rows else 0),
            ),
            consumer_mask=cutlass.Int32(0) if self.cluster_m > 1 else None,
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)
        slots = storage.sched_slots.get_tensor(cute.make_layout((4, self.sched_stages)))

        # (bM, bK, RestM, RestK), (bN, bK, RestN, RestK, E), (bM, bN_out, RestM, RestN)
        gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None))
        gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None, None))
        gB_mc = cute.local_tile(mB_mc, (self.tile_n, self.tile_k), (None, None, None))
        gC = cute.local_tile(mC, (self.tile_m, self.out_tile_n), (None, None))
        tAsA, tAgA = sA, gA
        if cutlass.const_expr(not self.token_rows):
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        tBsB_mc, tBgB_mc = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b_mc,
            rank,
            cute.make_layout(self.cluster_m),
            cute.group_modes(sB, 0, 2),
            cute.group_modes(gB_mc, 0, 2),
        )
        k_tiles = cute.size(gA, mode=[3])

        if cutlass.const_expr(self.weight_prefetch):
            # before the wait: the first unit's weight tile from the metadata as it reads now (a guess where the
            # previous kernel still writes it), its first K tiles into L2
            s_rows, s_counts = self.copy_metadata(storage, row_offsets, counts, tidx)
            cute.arch.sync_threads()
            if warp_idx == 0:
                if cluster_id < self.total_units(s_rows):
                    _, nb, expert, in_use, _, _ = self.decode_unit(cluster_id, s_rows, s_counts, pair_threshold, rank)
                    if in_use:
                        self.prefetch_weight_tiles(tma_atom_b, tBgB, nb, expert, k_tiles)
            cute.arch.sync_threads()  # (the guess read the SMEM copies that the copy below rewrites)
        self.await_previous_kernel()
        s_rows, s_counts = self.copy_metadata(storage, row_offsets, counts, tidx)
        cute.arch.sync_threads()

        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))

        if wg_idx == 0:
            # ---------------------------------------------------------- producer warpgroup
            cute.arch.setmaxregister_decrease(40)
            if cutlass.const_expr(self.token_rows):
                self.produce_token_rows(
                    tidx, warp_idx, mA, a_rows, rows_per_token, tma_atom_a, sA, tma_atom_b, tBgB, tBsB, mainloop,
                    sched, slots, s_rows, s_counts, workspace, pair_threshold, cluster_id, num_clusters, k_tiles,
                )
            elif warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sched_stages)
                total = self.total_units(s_rows)
                unit = self.fetch_unit(cluster_id, num_clusters, cluster_id, workspace, True, rank, total)
                if cutlass.const_expr(self.dynamic):
                    unit = self.publish_unit(unit, sched, sched_state, slots, rank)
                    sched_state.advance()  # pipeline states advance in the loop body, where the DSL carries them
                while unit < total:
                    m_block, nb, expert, in_use, has_valid, is_pair = self.decode_unit(
                        unit, s_rows, s_counts, pair_threshold, rank
                    )
                    # ask for the next unit now: the atomic's latency hides behind this unit's loads
                    next_unit = self.fetch_unit(cluster_id, num_clusters, unit, workspace, False, rank, total)
                    runs = cutlass.Boolean(True)
                    if cutlass.const_expr(self.skip_empty_units):
                        runs = has_valid
                    if runs:
                        for k in cutlass.range(k_tiles, unroll=1):
                            mainloop.producer_acquire(state)
                            bar = mainloop.producer_get_barrier(state)
                            cute.copy(tma_atom_a, tAgA[(None, m_block, k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                            if cutlass.const_expr(self.cluster_m > 1):
                                if is_pair:
                                    cute.copy(
                                        tma_atom_b_mc,
                                        tBgB_mc[(None, nb, k, expert)],
                                        tBsB_mc[(None, state.index)],
                                        tma_bar_ptr=bar,
                                        mcast_mask=cutlass.Int16((1 << self.cluster_m) - 1),
                                    )
                                else:
                                    cute.copy(tma_atom_b, tBgB[(None, nb, k, expert)], tBsB[(None, state.index)],
                                              tma_bar_ptr=bar)
                            else:
                                cute.copy(tma_atom_b, tBgB[(None, nb, k, expert)], tBsB[(None, state.index)],
                                          tma_bar_ptr=bar)
                            mainloop.producer_commit(state)
                            state.advance()
                    unit = next_unit
                    if cutlass.const_expr(self.dynamic):
                        unit = self.publish_unit(unit, sched, sched_state, slots, rank)
                        sched_state.advance()
                self.finish_dynamic(workspace, num_clusters, rank)
                self.scheduler_tail(sched, sched_state, rank)
                mainloop.producer_tail(state)
        else:
            # ---------------------------------------------------------- consumer warpgroups
            cute.arch.setmaxregister_increase(232 if self.num_consumer_wg > 1 else 240)
            wg = cutlass.Int32(0)  # pingpong: which consumer warpgroup (0 or 1) this thread belongs to
            if cutlass.const_expr(self.pingpong):
                wg = cute.arch.make_warp_uniform(wg_idx - 1)
            ctidx = tidx - self.threads_per_wg - wg * self.threads_per_wg
            wg_row0 = (ctidx // self.threads_per_wg) * 64  # COOPERATIVE: first tile row of this warpgroup
            thr_mma = tiled_mma.get_slice(ctidx)
            thr_out = out_tiled_mma.get_slice(ctidx)
            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            acc_shape = thr_mma.partition_shape_C((self.tile_m, self.tile_n))
            acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            out = acc  # plain epilogue: in place (saves tile_m * tile_n / threads registers)
            if cutlass.const_expr(self.gated):
                out = cute.make_rmem_tensor(thr_out.partition_shape_C((self.tile_m, self.out_tile_n)), self.acc_dtype)
            coords_acc = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
            coords_out = thr_out.partition_C(cute.make_identity_tensor((self.tile_m, self.out_tile_n)))
            num_k_blocks = cute.size(tCrA, mode=[2])

            # epilogue copies: registers -> SMEM (stmatrix), SMEM -> global (TMA)
            copy_atom_r2s = sm90_utils.get_smem_store_op(self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype)
            copy_atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.c_dtype)
            tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, out_tiled_mma)
            tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
            thr_copy_r2s = tiled_copy_r2s.get_slice(ctidx)
            tRS_sD = thr_copy_r2s.partition_D(sC)
            tRS_rOut = tiled_copy_r2s.retile(out)
            rd_shape = cute.shape(thr_copy_r2s.partition_S(sC))
            tRS_rD = cute.make_rmem_tensor(rd_shape[:3], self.acc_dtype)
            tRS_rD_out = cute.make_rmem_tensor(rd_shape[:3], self.c_dtype)
            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_wg * self.threads_per_wg),
            )
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            sched_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sched_stages)
            epi_count = cutlass.Int32(0)
            unit = cluster_id
            if cutlass.const_expr(self.dynamic):
                unit = self.read_published_unit(sched, sched_read, slots)
                sched_read.advance()
            total = self.total_units(s_rows)
            if cutlass.const_expr(not self.pingpong):
                # EpilogueStore.UNDER_NEXT_MAINLOOP: `held` keeps the previous unit's output tile in C's dtype, and
                # the first `under` K tiles of the next unit each store one of its epilogue sub-tiles under their
                # MMAs (the rest after that unit's mainloop; the last unit's after the loop). Both warpgroups store
                # the same sub-tiles in the same K tiles (the stores synchronize the two), SKIP included.
                epi_num = (self.tile_m // self.epi_tile[0]) * (self.out_tile_n // self.epi_tile[1])
                under = min(epi_num, k_tiles) if cutlass.const_expr(self.store_under_next) else 0
                # ACTIVATION_UNDER_NEXT_MAINLOOP: `held` keeps output i's gate and up in one 32-bit word (i in the
                # output tile's register order), and each sub-tile's activation runs when it is stored
                held = cute.make_rmem_tensor(cute.size(tRS_rOut), cutlass.Int32) if cutlass.const_expr(
                    self.activation_under_next) else cute.make_rmem_tensor_like(tRS_rOut, self.c_dtype)
                up_out = out
                up_view = tRS_rOut
                if cutlass.const_expr(self.activation_under_next):
                    up_out = cute.make_rmem_tensor_like(out)  # the up columns, in `out`'s layout
                    up_view = tiled_copy_r2s.retile(up_out)
                pending = cutlass.Boolean(False)  # held holds a tile not stored yet (CTA-uniform)
                held_m_block = cutlass.Int32(0)
                held_nb = cutlass.Int32(0)
                while unit < total:
                    m_block, nb, expert, in_use, has_valid, is_pair = self.decode_unit(
                        unit, s_rows, s_counts, pair_threshold, rank
                    )
                    # ---- mainloop: one wgmma group in flight, release the stage of the previous group
                    runs = cutlass.Boolean(True)
                    if cutlass.const_expr(self.skip_empty_units):
                        runs = has_valid
                    if runs:
                        acc.fill(0.0)
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                        cute.nvgpu.warpgroup.fence()
                        multiplies = True
                        if cutlass.const_expr(self.skip_padding):
                            # this warpgroup's 64 rows start at wg_row0 of the tile; the valid rows of the tile's
                            # expert end at valid_end (warpgroup-uniform: a dynamic branch)
                            valid_end = s_rows[expert] + s_counts[expert] - m_block * self.tile_m
                            multiplies = wg_row0 < valid_end
                        held_tile = gC[(None, None, held_m_block, held_nb)]
                        if multiplies:
                            # the K tiles that store a held sub-tile (unrolled: a sub-tile's registers are static)
                            for ku in cutlass.range_constexpr(under):
                                mainloop.consumer_wait(read_state)
                                self.issue_k_tile(tiled_mma, acc, tCrA, tCrB, read_state.index)
                                if pending:
                                    epi_count = self.store_held_subtile(
                                        held, ku, held_tile, sC, tma_atom_c, tiled_copy_r2s, tRS_rD_out, tRS_sD,
                                        store_pipe, epi_count, warp_idx == 4,
                                    )
                                cute.nvgpu.warpgroup.wait_group(1)
                                if cutlass.const_expr(ku > 0):
                                    mainloop.consumer_release(release_state)
                                    release_state.advance()
                                read_state.advance()
                            for k in cutlass.range(under, k_tiles, unroll=1):
                                mainloop.consumer_wait(read_state)
                                self.issue_k_tile(tiled_mma, acc, tCrA, tCrB, read_state.index)
                                cute.nvgpu.warpgroup.wait_group(1)
                                if k > 0:
                                    mainloop.consumer_release(release_state)
                                    release_state.advance()
                                read_state.advance()
                            cute.nvgpu.warpgroup.wait_group(0)
                            if k_tiles > 0:
                                mainloop.consumer_release(release_state)
                                release_state.advance()
                        else:
                            # all 64 rows are padding: keep the stage phases in step (wait, then release, so an
                            # arrival never counts toward a later fill of the stage), no MMAs; acc stays 0
                            for ku in cutlass.range_constexpr(under):
                                mainloop.consumer_wait(read_state)
                                mainloop.consumer_release(release_state)
                                release_state.advance()
                                read_state.advance()
                                if pending:
                                    epi_count = self.store_held_subtile(
                                        held, ku, held_tile, sC, tma_atom_c, tiled_copy_r2s, tRS_rD_out, tRS_sD,
                                        store_pipe, epi_count, warp_idx == 4,
                                    )
                            for k in cutlass.range(under, k_tiles, unroll=1):
                                mainloop.consumer_wait(read_state)
                                mainloop.consumer_release(release_state)
                                release_state.advance()
                                read_state.advance()

                        # ---- epilogue (CTA-uniform branches: every consumer thread takes the same ones)
                        if cutlass.const_expr(self.store_under_next):
                            if pending:  # the held sub-tiles that this unit's K tiles did not cover
                                for j in cutlass.range_constexpr(under, epi_num):
                                    epi_count = self.store_held_subtile(
                                        held, j, held_tile, sC, tma_atom_c, tiled_copy_r2s, tRS_rD_out, tRS_sD,
                                        store_pipe, epi_count, warp_idx == 4,
                                    )
                            pending = has_valid
                            if has_valid:
                                if cutlass.const_expr(self.activation_under_next):
                                    self.hold_gate_up(acc, out, tRS_rOut, up_out, up_view, held, coords_acc, expert, nb,
                                                      bias)
                                else:
                                    self.apply_epilogue(acc, out, coords_acc, coords_out, expert, nb,
                                                        m_block * self.tile_m, bias, row_scale)
                                    held.store(tRS_rOut.load().to(self.c_dtype))
                                held_m_block = m_block
                                held_nb = nb
                        elif has_valid:
                            self.apply_epilogue(acc, out, coords_acc, coords_out, expert, nb, m_block * self.tile_m,
                                                bias, row_scale)
                            epi_count = self.store_tile(
                                gC[(None, None, m_block, nb)], sC, tma_atom_c, tiled_copy_r2s, tRS_rOut, tRS_rD,
                                tRS_rD_out, tRS_sD, store_pipe, self.epi_barrier, 0, epi_count, warp_idx == 4,
                            )
                    if cutlass.const_expr(self.dynamic):
                        unit = self.read_published_unit(sched, sched_read, slots)
                        sched_read.advance()
                    else:
                        unit = unit + num_clusters
                if cutlass.const_expr(self.store_under_next):
                    if pending:  # the last unit's tile
                        held_tile = gC[(None, None, held_m_block, held_nb)]
                        for j in cutlass.range_constexpr(epi_num):
                            epi_count = self.store_held_subtile(
                                held, j, held_tile, sC, tma_atom_c, tiled_copy_r2s, tRS_rD_out, tRS_sD,
                                store_pipe, epi_count, warp_idx == 4,
                            )
            else:
                # PINGPONG: warpgroup wg takes the units with even/odd ordinal; the mainloop pipeline holds
                # k_tiles stages per unit in unit order, so unit ordinal j starts at stage count j * k_tiles
                # Mainloops run strictly in unit order (WG0, WG1, WG0, ...): a warpgroup starts waiting on its
                # unit's stages only after the other finished waiting on the previous unit's. Without this,
                # both wait at once and an mbarrier parity wait can pass on a stage two phases old.
                epi_barrier = pipeline.NamedBarrier(barrier_id=1 + wg, num_threads=self.threads_per_wg)
                order_done = pipeline.NamedBarrier(barrier_id=3 + wg, num_threads=2 * self.threads_per_wg)
                order_wait = pipeline.NamedBarrier(barrier_id=4 - wg, num_threads=2 * self.threads_per_wg)
                seen = cutlass.Int32(0)
                while unit < total:
                    if seen % 2 == wg:
                        m_block, nb, expert, in_use, has_valid, is_pair = self.decode_unit(
                            unit, s_rows, s_counts, pair_threshold, rank
                        )
                        pos = seen * k_tiles
                        rd = pipeline.PipelineState(self.stages, pos, pos % self.stages, (pos // self.stages) % 2)
                        rl = pipeline.PipelineState(self.stages, pos, pos % self.stages, (pos // self.stages) % 2)
                        if seen > 0:
                            order_wait.arrive_and_wait()  # the other warpgroup is done with unit seen - 1
                        acc.fill(0.0)
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                        cute.nvgpu.warpgroup.fence()
                        for k in cutlass.range(k_tiles, unroll=1):
                            mainloop.consumer_wait(rd)
                            for kb in cutlass.range_constexpr(num_k_blocks):
                                coord = (None, None, kb, rd.index)
                                cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                            cute.nvgpu.warpgroup.commit_group()
                            cute.nvgpu.warpgroup.wait_group(1)
                            if k > 0:
                                mainloop.consumer_release(rl)
                                rl.advance()
                            rd.advance()
                        order_done.arrive()  # let the other warpgroup's mainloop start
                        cute.nvgpu.warpgroup.wait_group(0)
                        if k_tiles > 0:
                            mainloop.consumer_release(rl)
                            rl.advance()
                        if has_valid:
                            self.apply_epilogue(acc, out, coords_acc, coords_out, expert, nb, m_block * self.tile_m,
                                                bias, row_scale)
                            epi_count = self.store_tile(
                                gC[(None, None, m_block, nb)], sC, tma_atom_c, tiled_copy_r2s, tRS_rOut, tRS_rD,
                                tRS_rD_out, tRS_sD, store_pipe, epi_barrier, wg * self.epi_stages, epi_count,
                                warp_idx == 4 + 4 * wg,
                            )
                    seen = seen + 1
                    if cutlass.const_expr(self.dynamic):
                        unit = self.read_published_unit(sched, sched_read, slots)
                        sched_read.advance()
                    else:
                        unit = unit + num_clusters
            store_pipe.producer_tail()

    # ------------------------------------------------------------------ A_TOKEN_ROWS producer
    @cute.jit
    def produce_token_rows(self, tidx, warp_idx, mA, a_rows, rows_per_token, cp_atom, sA, tma_atom_b, tBgB, tBsB,
                           mainloop, sched, slots, s_rows, s_counts, workspace, pair_threshold, cluster_id,
                           num_clusters, k_tiles):
        """The producer warpgroup with A_TOKEN_ROWS (SINGLE units): all four warps copy the unit's token rows
        into each stage by cp.async (thread t: rows t // 8 + 16 i, 16-byte chunk t % 8 of each 64-column slice)
        and arrive on the stage's full barrier when they landed (cp.async.mbarrier.arrive.noinc, counted in the
        barrier's arrival count); warp 0 also loads B by TMA and sets the transaction bytes. DYNAMIC: warp 0's
        lane 0 fetches and publishes each unit, and all four warps read it back from the scheduler slot."""
        row_stride = mA.layout.stride[0]
        base = mA.iterator.toint()
        num_tokens = cutlass.max(cutlass.Int32(mA.shape[0]), cutlass.Int32(1))
        thread_layout = cute.make_layout((16, 8), stride=(8, 1))
        tiled_copy = cute.make_tiled_copy_tv(cp_atom, thread_layout, cute.make_layout((1, CP_ASYNC_CHUNK)))
        thr_copy = tiled_copy.get_slice(tidx)
        tAsA = thr_copy.partition_D(sA)  # (CPY, tile_m / 16, tile_k / 64, stages)
        rows_per_thread = self.tile_m // 16
        slices = self.tile_k // 64
        row0 = tidx // 8
        col0 = (tidx % 8) * CP_ASYNC_CHUNK
        tokens = cute.make_rmem_tensor(cute.make_layout(rows_per_thread), cutlass.Int32)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sched_stages)
        sched_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sched_stages)
        unit = cluster_id
        total = self.total_units(s_rows)
        if cutlass.const_expr(self.dynamic):
            if warp_idx == 0:
                first = self.fetch_unit(cluster_id, num_clusters, cluster_id, workspace, True, 0, total)
                self.publish_unit(first, sched, sched_state, slots, 0)
            sched_state.advance()  # (every warp keeps a copy; warp 0's is the one in use)
            unit = self.read_published_unit(sched, sched_read, slots)
            sched_read.advance()
        while unit < total:
            m_block, nb, expert, in_use, has_valid, is_pair = self.decode_unit(unit, s_rows, s_counts, pair_threshold, 0)
            next_unit = unit + num_clusters
            if cutlass.const_expr(self.dynamic):
                if warp_idx == 0:  # ask for the next unit now: the atomic's latency hides behind the loads
                    next_unit = self.fetch_unit(cluster_id, num_clusters, unit, workspace, False, 0, total)
            runs = cutlass.Boolean(True)
            if cutlass.const_expr(self.skip_empty_units):
                runs = has_valid
            if runs:
                first_row = m_block * self.tile_m + row0
                for i in cutlass.range_constexpr(rows_per_thread):
                    row = first_row + 16 * i
                    slot = a_rows[row]
                    # a padding row reads some token's row: activation-like values (the GEMMs run faster on those than
                    # on zeros, see GatherPadding), and a different one per row (one shared row, read by every padding
                    # row of every CTA at once, is an L2 hot spot)
                    token = row % num_tokens
                    if slot >= 0:
                        token = slot // rows_per_token
                    tokens[i] = token
                for k in cutlass.range(k_tiles, unroll=1):
                    if warp_idx == 0:
                        mainloop.producer_acquire(state)
                        cute.copy(tma_atom_b, tBgB[(None, nb, k, expert)], tBsB[(None, state.index)],
                                  tma_bar_ptr=mainloop.producer_get_barrier(state))
                    else:
                        mainloop.sync_object_empty.wait(state.index, state.phase)
                    for i in cutlass.range_constexpr(rows_per_thread):
                        row_base = cutlass.Int64(tokens[i]) * row_stride + k * self.tile_k + col0
                        for j in cutlass.range_constexpr(slices):
                            dst = tAsA[(None, i, j, state.index)]
                            src_ptr = cute.make_ptr(
                                self.ab_dtype, base + (row_base + j * 64) * (self.ab_dtype.width // 8),
                                cute.AddressSpace.gmem, assumed_align=16,
                            )
                            cute.copy(cp_atom, cute.make_tensor(src_ptr, cute.make_layout(dst.shape)), dst)
                    cute.arch.cp_async_mbarrier_arrive_noinc(mainloop.producer_get_barrier(state))
                    state.advance()
            if cutlass.const_expr(self.dynamic):
                if warp_idx == 0:
                    self.publish_unit(next_unit, sched, sched_state, slots, 0)
                sched_state.advance()
                unit = self.read_published_unit(sched, sched_read, slots)
                sched_read.advance()
            else:
                unit = next_unit
        if warp_idx == 0:
            self.finish_dynamic(workspace, num_clusters, 0)
            mainloop.producer_tail(state)

    # ------------------------------------------------------------------ mainloop
    @cute.jit
    def issue_k_tile(self, tiled_mma, acc, tCrA, tCrB, stage):
        """The MMAs of one K tile (SMEM stage `stage`) as one committed wgmma group. It fences first (as CUTLASS
        does): where ptxas has to insert the fence itself on a divergent path it serializes every wgmma (C7520;
        it did in the PAIR kernels, tests/test_sm90_compile.py checks)."""
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            coord = (None, None, kb, stage)
            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
        cute.nvgpu.warpgroup.commit_group()

    # ------------------------------------------------------------------ scheduling
    @cute.jit
    def fetch_unit(self, cluster_id, num_clusters, previous, workspace, is_first: cutlass.Constexpr, rank,
                   total=None):
        """Producer warp: the next unit (STATIC: arithmetic; DYNAMIC: one atomic by lane 0 of the cluster's
        rank 0, broadcast to the warp; rank 1 gets the unit from publish_unit instead).

        DYNAMIC_SIDES (needs `total`): the units [0, half) belong to side 0 and [half, total) to side 1 (half =
        ceil(total / 2)); a cluster takes the next unit of its SM's side (workspace[4 + smid]) from that side's
        counter, and once its side has none left, the next one of the other side (`total` when neither has)."""
        unit = cluster_id
        if cutlass.const_expr(not is_first):
            unit = previous + num_clusters
        if cutlass.const_expr(self.sides):
            lane = cute.arch.lane_idx()
            fetched = cutlass.Int32(0)
            if lane == 0 and rank == 0:
                sm = cutlass.min(cutlass.Int32(cute.arch.smid()), cutlass.Int32(SIDE_MAP_ENTRIES - 1))
                side = workspace[SIDE_MAP_OFFSET + sm]
                half = (total + 1) // 2
                own_count = half + side * (total - 2 * half)  # side 0: half; side 1: total - half
                taken = cute.arch.atomic_add(workspace.iterator + 2 * side, cutlass.Int32(1))
                fetched = side * half + taken
                if taken >= own_count:
                    other = 1 - side
                    stolen = cute.arch.atomic_add(workspace.iterator + 2 * other, cutlass.Int32(1))
                    fetched = other * half + stolen
                    if stolen >= total - own_count:
                        fetched = total
            unit = cute.arch.shuffle_sync(fetched, 0)
        elif cutlass.const_expr(self.dynamic):
            lane = cute.arch.lane_idx()
            fetched = cutlass.Int32(0)
            if lane == 0 and rank == 0:
                fetched = cute.arch.atomic_add(workspace.iterator, cutlass.Int32(1))
            unit = cute.arch.shuffle_sync(fetched, 0)
        return unit

    @cute.jit
    def publish_unit(self, unit, sched, sched_state, slots, rank) -> cutlass.Int32:
        """Producer warp -> consumers: the unit id through an SMEM slot (DYNAMIC; the caller advances).

        Returns the unit this CTA works on: its own fetch, or in rank 1 of a cluster the one rank 0 stored
        into its slot (rank 1's producer reads the slot like a consumer: its state is a producer state, so
        the "full" phase it waits for is the state's phase flipped)."""
        lane = cute.arch.lane_idx()
        index = sched_state.index
        result = unit
        if cutlass.const_expr(self.cluster_m == 1):
            if lane == 0:
                sched.producer_acquire(sched_state)
                slots[(0, index)] = unit
                sched.producer_commit(sched_state)
        else:
            received = cutlass.Int32(0)
            if rank == 0:
                if lane == 0:
                    sched.producer_acquire(sched_state)  # every reader of both CTAs released this slot
                    slots[(0, index)] = unit
                    sched.producer_commit(sched_state)
                    cute.arch.store_async_dsmem(
                        slots.iterator + 4 * index, unit, sched.sync_object_full.get_barrier(index), 1
                    )
                received = unit
            else:
                if lane == 0:
                    full = sched.sync_object_full.get_barrier(index)
                    cute.arch.mbarrier_arrive_and_expect_tx(full, 4)
                    cute.arch.mbarrier_wait(full, sched_state.phase ^ 1)
                    received = slots[(0, index)]
                    sched.consumer_release(sched_state)
                received = cute.arch.shuffle_sync(received, 0)
            result = received
        return result

    @cute.jit
    def scheduler_tail(self, sched, sched_state, rank):
        """DYNAMIC clusters: rank 0 waits until every reader of both CTAs released every slot, so that no
        remote arrive from rank 1 targets rank 0's shared memory after rank 0 exited."""
        if cutlass.const_expr(self.dynamic and self.cluster_m > 1):
            if cute.arch.lane_idx() == 0 and rank == 0:
                for i in cutlass.range_constexpr(self.sched_stages):
                    position = sched_state.index + i
                    index = position % self.sched_stages
                    phase = sched_state.phase ^ (position // self.sched_stages)
                    sched.sync_object_empty.wait(index, phase)

    @cute.jit
    def read_published_unit(self, sched, sched_read, slots):
        """Consumer side of publish_unit (the caller advances sched_read)."""
        sched.consumer_wait(sched_read)
        unit = slots[(0, sched_read.index)]
        sched.consumer_release(sched_read)
        return unit

    @cute.jit
    def finish_dynamic(self, workspace, num_fetchers, rank):
        """Epoch reset: the last fetching CTA (rank 0 of each cluster) to finish zeroes the counter for the
        next launch."""
        if cutlass.const_expr(self.dynamic):
            if cute.arch.lane_idx() == 0 and rank == 0:
                cute.arch.fence_acq_rel_gpu()
                done = cute.arch.atomic_add(workspace.iterator + 1, cutlass.Int32(1))
                if done == num_fetchers - 1:
                    workspace[0] = cutlass.Int32(0)
                    workspace[1] = cutlass.Int32(0)
                    if cutlass.const_expr(self.sides):
                        workspace[2] = cutlass.Int32(0)
