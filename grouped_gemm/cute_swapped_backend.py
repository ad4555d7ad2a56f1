"""Hopper (sm_90a) grouped GEMM with swapped operands (weights as the wgmma M side), in CuTe DSL.

Imports `cutlass` at the top: import it lazily (sm90_grouped_gemm.py does), never from a package __init__.

Same problem and metadata as cute_backend.py (A [M, K] rows in padded expert order, B [E, N, K], C [M,
N_out], row_offsets / counts on the device, symbolic M). Here the operands swap roles: the expert's weight rows
are wgmma's M side (64 rows per instruction, tile_n per unit) and the token rows are its N side, so a unit
multiplies C^T[tile_n, rows] = B_e[tile_n, K] @ A[rows, K]^T. N can be any multiple of 8, so an expert's
rows cost at most a few padding rows, where the 128-row token-as-M tiles of cute_backend.py multiply up to
127 and stream the expert's weights once per m-block.

Two sizes of token tile, one kernel family:
- decode (tile_m 8..64): one consumer warpgroup, every unit multiplies tile_m token rows (at a few rows per
  expert the tensor cores idle while the weights stream at HBM bandwidth).
- wide (tile_m 128, 160, 256 or 288): two consumer warpgroups (one for 64 weight rows), each of one or two 64-row
  wgmma atoms of weight rows, and the wgmma N chosen per unit on the device: the tile's valid rows rounded up to
  `token_step` (N = token_step, 2 * token_step, ..., tile_m; one mainloop per N, selected by a
  warpgroup-uniform branch; each writes the first N / 2 registers of every atom's accumulator, which is the
  narrower accumulator's register order). A tile above 256 rows (wgmma's largest N) multiplies an N above its
  half as two wgmma, the first half and the rest, whose accumulators follow each other in that order. The
  producer loads only the TMA boxes of the token tile that hold valid rows (64-row boxes; 32-row ones for tile_m
  160 and 288) and sets each stage's transaction bytes to match. tile_m 160 with 256 weight rows holds an expert of
  up to 160 rows in one unit on a regular stage's weight bytes; tile_m 288 with 128 weight rows one of up to 288
  rows (256 +- 32).

Work units: (token tile, n-block). Token tiles are counted per expert, ceil(counts[e] / tile_m), so tiles
of padding rows do not exist (the 128-row padding of the dispatch would otherwise make most units empty);
every CTA builds that prefix sum in SMEM at start (one warp, shuffle scan). A wide tile holds tile_m rows of its
expert, the rest going to the last (ExpertSplit.FILL), or the same share of them rounded up to the TMA box
(ExpertSplit.EVEN: 320 rows on 288-row tiles as 160 + 160, not 288 + 32). Raster ALONG_M puts the
token tiles of one n-block next to each other, so experts with several tiles share the weight tile in L2;
ALONG_N puts the n-blocks of one token tile next to each other (the token tile stays in L2, and the CTAs
in flight stream the neighbouring weight tiles of a few experts). Measured and removed (docs/perf-notes-sm90.md v20):
an expert's tiles of one n-block next to each other, expert by expert, slower in every cell (up to 1.36x): which
CTAs share an operand matters, and ALONG_N gives a token tile to consecutive ones.

Where the token rows come from (a_source): A_COPY, the gathered copy in padded expert order, by TMA; or, wide GEMM1
tiles, A_TOKEN_ROWS: the token matrix [T, K] itself, row r of the padded order reading token a_rows[r] //
rows_per_token (a_rows = the dispatch's sorted_slots), so the layer runs no gather launch.

Warp roles (128 threads per warpgroup; decode: 256 threads, wide: 384, or 256 for 64 weight rows):
- warpgroup 0, warp 0: TMA producer (per unit: the K tiles of the token tile and of the weight tile into
  the next free stage); DYNAMIC: fetches units from the global counter as in cute_backend.py.
  A_TOKEN_ROWS: all four warps produce. At each unit every thread looks up the tokens of its rows (thread t: rows
  t // 8 + 16 i, valid rows only) into SMEM (one lane per row writes, between warp barriers); per stage it copies 16-byte chunk t % 8 of each of those rows'
  64-column slices by cp.async into the swizzled stage and arrives on the stage's full barrier when they landed
  (.noinc); warp 0 also loads the weight tile by TMA with its transaction bytes. Rows past the unit's valid rows
  are not copied (their products land in columns never stored).
- warpgroups 1..: the consumers. wgmma with the weight tile as A (decode: tile_n / 64 instructions per k-block
  in one warpgroup; wide: 64 or 128 weight rows per warpgroup) and the token tile as B, one wgmma group in
  flight. Each thread holds weight rows r and r + 8 of every 16, which the w13 prepack (8 gate rows, then the
  8 matching up rows) makes a gate / up pair of one output column, so the gated activation needs no data
  exchange. Epilogue: decode units store from registers straight to global memory (a few KB per unit); wide
  units run the epilogue math in registers first (its bias and row-scale loads before any store), then, per
  pass of 32-64 tokens, stmatrix.trans into a padded SMEM tile [tokens][output columns] and 16-byte row
  stores from there (the consumer warpgroups meet at a named barrier around each pass). Rows past the
  expert's count (padding, or the next expert's rows) are never stored.
Pipelines: mainloop (PipelineTmaAsync, `stages` deep; "full" = the stage's weight and token bytes landed,
a byte count the wide producer sets per unit (A_TOKEN_ROWS: the weight bytes and 128 more arrivals, one per producer
thread whose copies landed); "empty" = every consumer warp released it) and DYNAMIC's scheduler slot, as in
cute_backend.py (A_TOKEN_ROWS: the four producer warps read every unit too). The producer and consumer loops mirror cute_backend.py's in the kernel
body on purpose: a pipeline state advanced inside a helper is not carried back through the DSL's loop (the
v1 hang recorded in docs/perf-notes-sm90.md).

Launch: as cute_backend.py's (dependent_launch): with the weight prefetch the producer warp decodes its first unit
from SMEM copies of the metadata and the token-tile prefix sum made before the wait, and both are made again after it.

Registers: setmaxnreg moves registers only within the CTA's launch allocation, so the producer warpgroup stays at 40
beside the consumers' 232 (asking 48 left the consumers' increase waiting forever: measured as a hang).

Limits: cluster 1 (no multicast), bf16/fp16, K % 8 == 0 (A_TOKEN_ROWS: wide GEMM1 tiles, K % tile_k == 0, tile_k a
multiple of 64); decode: N % tile_n == 0, tile_n a multiple of 64
(<= 256), tile_m in {8, 16, 32, 64} dividing the row_offsets alignment; wide: tile_n 64, 128 or 256, tile_m 128,
160, 256 or 288 with tile_m * tile_n <= 160 * 256 (accumulator registers), token_step a multiple of 8 dividing
tile_m (of 16 above 256 rows: each half is a wgmma N), row_offsets multiples of 64, and a partial last n-block where
N is no multiple of tile_n (TMA zero-fills the weight rows past N; their columns are neither loaded from the bias
nor stored).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.experimental import primitives as prims
from cutlass.pipeline import pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from .cute_backend import (A_COPY, A_TOKEN_ROWS, CONSUMERS_COOPERATIVE, CP_ASYNC_CHUNK, LAUNCH_STREAM_ORDER, RASTER_N,
                           SCHED_DYNAMIC, Sm90GroupedGemmKernel)
from .sm90_config import WGMMA_MAX_N, WIDE_EPI_PAD, ExpertSplit, wide_epilogue_rows, wide_token_box

WIDE_MIN_TILE_M = 64  # token tiles above this are "wide": several consumer warpgroups, wgmma N chosen per unit
# (WIDE_EPI_PAD: 16 bytes per staging row, so that the 8 rows one stmatrix fragment writes hit distinct banks)


class Sm90SwappedGroupedGemmKernel(Sm90GroupedGemmKernel):
    """Weights as wgmma's M side, tokens as its N side; one producer warp, 1 (decode) or tile_n / 64 (wide)
    consumer warpgroups."""

    def __init__(self, *, tile_m, tile_n, tile_k, stages, epilogue, has_bias, has_row_scale, num_experts, scheduler,
                 raster, token_step=0, expert_split=ExpertSplit.FILL.value, a_source=A_COPY,
                 dependent_launch=LAUNCH_STREAM_ORDER):
        super().__init__(
            tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, stages=stages, cluster_m=1, epilogue=epilogue,
            has_bias=has_bias, has_row_scale=has_row_scale, num_experts=num_experts, scheduler=scheduler,
            raster=raster, consumers=CONSUMERS_COOPERATIVE, a_source=a_source,
            dependent_launch=dependent_launch,
        )
        self.wide = tile_m > WIDE_MIN_TILE_M
        # wide: two consumer warpgroups (one for 64 weight rows), each 64 or 128 weight rows (1 or 2 wgmma atoms)
        self.num_consumer_wg = min(2, tile_n // 64) if self.wide else 1
        self.mma_wg = self.num_consumer_wg
        self.threads = (1 + self.num_consumer_wg) * self.threads_per_wg
        self.num_consumer_threads = self.num_consumer_wg * self.threads_per_wg
        self.scan_per_lane = (num_experts + 31) // 32  # experts per lane in the token-tile prefix sum
        # wide: the wgmma N sizes a unit may take (valid rows rounded up to token_step), the token tile's TMA
        # boxes (wide_token_box rows each, only those holding valid rows are loaded)
        self.token_step = token_step if self.wide and token_step else tile_m
        self.token_sizes = tuple(range(self.token_step, tile_m + 1, self.token_step))
        # the largest wgmma N of the tile: tile_m, or its half above wgmma's largest N (token_parts)
        self.mma_tile_m = tile_m if tile_m <= WGMMA_MAX_N else tile_m // 2
        if tile_m > WGMMA_MAX_N and tile_n > 64 * self.num_consumer_wg:
            # (the second part's accumulators start at register mma_tile_m / 2 of the one atom per warpgroup)
            raise ValueError(f"tile_n: a {tile_m}-row token tile takes one wgmma atom per warpgroup, got {tile_n}")
        self.token_box = wide_token_box(tile_m) if self.wide else tile_m
        self.token_boxes = tile_m // self.token_box
        self.even_split = self.wide and expert_split == ExpertSplit.EVEN.value
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_consumer_threads)
        self.epi_rows = wide_epilogue_rows(tile_m, tile_n, self.gated)  # SMEM [epi_rows tokens][out columns + pad]
        self.epi_pitch = self.out_tile_n + WIDE_EPI_PAD
        self.epi_elems = self.epi_rows * self.epi_pitch if self.wide else 8

    # ------------------------------------------------------------------ host side (trace time)
    # (the entry points, __call__ for A_COPY and call_token_rows for A_TOKEN_ROWS, are the base class's: both call
    # launch; pair_threshold is unused here, kept so that every sm90 kernel has one signature)
    @cute.jit
    def launch(self, a, a_rows, rows_per_token, b, c, row_offsets, counts, bias, row_scale, workspace, pair_threshold,
               num_ctas, stream):
        """Trace-time set-up (MMA atom, SMEM layouts, copy atoms, shared storage) and the launch."""
        self.ab_dtype = a.element_type
        self.c_dtype = c.element_type
        self.n = b.shape[1]
        self.n_blocks = (self.n + self.tile_n - 1) // self.tile_n  # wide: a partial last n-block (TMA zero-fills)
        kmajor = cute.nvgpu.OperandMajorMode.K
        # MMA problem per unit: M = weight rows (tile_n), N = token rows (tile_m)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, kmajor, kmajor, self.acc_dtype, (self.mma_wg, 1, 1),
            tiler_mn=(64, self.mma_tile_m),
        )
        mma_mnk = (self.tile_n, self.tile_m, self.tile_k)
        w_smem_staged = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, mma_mnk, self.ab_dtype, self.stages)
        t_smem_staged = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, mma_mnk, self.ab_dtype, self.stages)
        # the token tile as TMA boxes: stage s, box j is box-stage s * token_boxes + j of the same bytes (a
        # K-major 128B-swizzled tile is a stack of 8-row atoms, so 64-row boxes tile it exactly)
        t_box_staged = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (self.tile_n, self.token_box, self.tile_k), self.ab_dtype,
            self.stages * self.token_boxes,
        )
        b_nke = cute.make_tensor(b.iterator, cute.select(b.layout, mode=[1, 2, 0]))  # expert = batch mode
        t_box_one = cute.slice_(t_box_staged, (None, None, 0))
        w_smem_one = cute.slice_(w_smem_staged, (None, None, 0))
        if cutlass.const_expr(self.token_rows):
            # 16-byte cp.async per thread (the producer warpgroup: 16 rows x 8 chunks of 8 elements per copy)
            tma_atom_t = cute.make_copy_atom(
                cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL), self.ab_dtype,
                num_bits_per_copy=128,
            )
            tma_t = a
        else:
            tma_atom_t, tma_t = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), a, t_box_one, (self.token_box, self.tile_k)
            )
        tma_atom_w, tma_w = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), b_nke, w_smem_one, (self.tile_n, self.tile_k)
        )
        self.box_bytes = cute.size_in_bytes(self.ab_dtype, t_box_one)
        self.w_bytes = cute.size_in_bytes(self.ab_dtype, w_smem_one)
        self.tma_bytes = self.token_boxes * self.box_bytes + self.w_bytes

        @cute.struct
        class SharedStorage:
            mainloop_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sched_barriers: cute.struct.MemRange[cutlass.Int64, self.sched_stages * 2]
            sched_slots: cute.struct.MemRange[cutlass.Int32, self.sched_stages * 4]
            expert_rows: cute.struct.MemRange[cutlass.Int32, self.num_experts + 1]
            expert_counts: cute.struct.MemRange[cutlass.Int32, self.num_experts]
            expert_tiles: cute.struct.MemRange[cutlass.Int32, self.num_experts + 1]
            tile_tokens: cute.struct.MemRange[cutlass.Int32, self.tile_m if self.token_rows else 1]  # A_TOKEN_ROWS
            sT: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(t_smem_staged)], self.buffer_align_bytes]
            sW: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(w_smem_staged)], self.buffer_align_bytes]
            sOut: cute.struct.Align[cute.struct.MemRange[self.c_dtype, self.epi_elems], 128]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_atom_t, tma_t, a_rows, rows_per_token, tma_atom_w, tma_w, c, row_offsets, counts, bias, row_scale,
            workspace, t_smem_staged, t_box_staged, w_smem_staged, self.tiled_mma,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), min_blocks_per_mp=1, stream=stream,
                 use_pdl=self.programmatic)

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def scan_token_tiles(self, counts: cute.Tensor, s_tiles: cute.Tensor):
        """One warp: s_tiles[e] = sum over e' < e of ceil(counts[e'] / tile_m), s_tiles[E] = the total."""
        lane = cute.arch.lane_idx()
        first = lane * self.scan_per_lane
        local = cutlass.Int32(0)
        for j in cutlass.range_constexpr(self.scan_per_lane):
            if first + j < self.num_experts:
                local = local + (counts[first + j] + (self.tile_m - 1)) // self.tile_m
        inclusive = local
        for step in cutlass.range_constexpr(5):
            below = cute.arch.shuffle_sync_up(inclusive, 1 << step)
            if lane >= (1 << step):
                inclusive = inclusive + below
        running = inclusive - local
        for j in cutlass.range_constexpr(self.scan_per_lane):
            if first + j < self.num_experts:
                s_tiles[first + j] = running
                running = running + (counts[first + j] + (self.tile_m - 1)) // self.tile_m
        if lane == 31:
            s_tiles[self.num_experts] = inclusive

    @cute.jit
    def decode_swapped_unit(self, unit: cutlass.Int32, s_tiles: cute.Tensor, s_rows: cute.Tensor,
                            s_counts: cute.Tensor):
        """unit -> (first row of its token tile in A, n_block, expert, valid rows of the tile); every token tile
        holds at least one valid row."""
        total_tiles = s_tiles[self.num_experts]
        tile = unit % total_tiles
        nb = unit // total_tiles
        if cutlass.const_expr(self.raster == RASTER_N):
            nb = unit % self.n_blocks
            tile = unit // self.n_blocks
        expert = self.expert_of_row(s_tiles, tile)  # largest e with s_tiles[e] <= tile: a non-empty expert
        count = s_counts[expert]
        rows = cutlass.Int32(self.tile_m)
        if cutlass.const_expr(self.even_split):
            # ExpertSplit.EVEN: ceil(count / tiles) rows per tile, rounded up to the TMA box (at most tile_m, as
            # tile_m is a multiple of the box; the last tile keeps at least one row: (tiles - 1) * tile_m < count)
            tiles = s_tiles[expert + 1] - s_tiles[expert]
            share = (count + tiles - 1) // tiles
            rows = (share + (self.token_box - 1)) // self.token_box * self.token_box
        first = (tile - s_tiles[expert]) * rows  # within the expert
        valid = cutlass.min(rows, count - first)
        return s_rows[expert] + first, nb, expert, valid

    # ------------------------------------------------------------------ the kernel
    @cute.kernel
    def kernel(
        self,
        tma_atom_t: cute.CopyAtom,
        mT: cute.Tensor,
        a_rows: cute.Tensor,
        rows_per_token: cutlass.Int32,
        tma_atom_w: cute.CopyAtom,
        mW: cute.Tensor,
        mC: cute.Tensor,
        row_offsets: cute.Tensor,
        counts: cute.Tensor,
        bias: cute.Tensor,
        row_scale: cute.Tensor,
        workspace: cute.Tensor,
        t_smem_staged: cute.ComposedLayout,
        t_box_staged: cute.ComposedLayout,
        w_smem_staged: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        if warp_idx == 0:
            if cutlass.const_expr(not self.token_rows):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_t)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_w)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # A_TOKEN_ROWS: the whole producer warpgroup copies (one more "full" arrival per thread) and reads each unit
        mainloop, sched = self.single_cta_pipelines(storage, self.tma_bytes,
                                                    self.threads_per_wg if self.token_rows else 0)

        sT_box = storage.sT.get_tensor(t_box_staged.outer, swizzle=t_box_staged.inner)
        sW = storage.sW.get_tensor(w_smem_staged.outer, swizzle=w_smem_staged.inner)
        sOut = storage.sOut.get_tensor(cute.make_layout((self.epi_rows, self.epi_pitch), stride=(self.epi_pitch, 1))
                                       if self.wide else cute.make_layout(self.epi_elems))
        slots = storage.sched_slots.get_tensor(cute.make_layout((4, self.sched_stages)))
        s_tiles = storage.expert_tiles.get_tensor(cute.make_layout(self.num_experts + 1))

        # (box, bK, RestBoxes, RestK) token boxes, (bN, bK, RestN, RestK, E) weight tiles
        gT = cute.local_tile(mT, (self.token_box, self.tile_k), (None, None))
        gW = cute.local_tile(mW, (self.tile_n, self.tile_k), (None, None, None))
        tTsT, tTgT = sT_box, gT
        if cutlass.const_expr(not self.token_rows):
            tTsT, tTgT = cute.nvgpu.cpasync.tma_partition(
                tma_atom_t, 0, cute.make_layout(1), cute.group_modes(sT_box, 0, 2), cute.group_modes(gT, 0, 2)
            )
        tWsW, tWgW = cute.nvgpu.cpasync.tma_partition(
            tma_atom_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2)
        )
        k_tiles = cute.size(gT, mode=[3])

        if cutlass.const_expr(self.weight_prefetch):
            # before the wait: the first unit's weight tile from the metadata as it reads now (a guess where the
            # previous kernel still writes it), its first K tiles into L2
            s_rows, s_counts = self.copy_metadata(storage, row_offsets, counts, tidx)
            if warp_idx == 1:
                self.scan_token_tiles(counts, s_tiles)
            cute.arch.sync_threads()
            if warp_idx == 0:
                if bidx < s_tiles[self.num_experts] * self.n_blocks:
                    _, nb, expert, _ = self.decode_swapped_unit(bidx, s_tiles, s_rows, s_counts)
                    self.prefetch_weight_tiles(tma_atom_w, tWgW, nb, expert, k_tiles)
            cute.arch.sync_threads()  # (the guess read the SMEM copies that the copies below rewrite)
        self.await_previous_kernel()
        s_rows, s_counts = self.copy_metadata(storage, row_offsets, counts, tidx)
        if warp_idx == 1:
            self.scan_token_tiles(counts, s_tiles)
        cute.arch.sync_threads()
        total = s_tiles[self.num_experts] * self.n_blocks

        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if wg_idx == 0:
            # ---------------------------------------------------------- producer warp
            # (40: with the consumers' 232 exactly the CTA's registers at launch, the pool setmaxnreg moves them in;
            # a producer asking for more leaves the consumers' increase waiting forever)
            cute.arch.setmaxregister_decrease(40)
            if cutlass.const_expr(self.token_rows):
                sT = storage.sT.get_tensor(t_smem_staged.outer, swizzle=t_smem_staged.inner)
                s_tokens = storage.tile_tokens.get_tensor(cute.make_layout(self.tile_m))
                self.produce_token_rows_wide(
                    tidx, warp_idx, mT, a_rows, rows_per_token, tma_atom_t, sT, s_tokens, tma_atom_w, tWgW, tWsW,
                    mainloop, sched, slots, s_tiles, s_rows, s_counts, workspace, bidx, gdim, k_tiles, total,
                )
            elif warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sched_stages)
                unit = self.fetch_unit(bidx, gdim, bidx, workspace, True, cutlass.Int32(0))
                if cutlass.const_expr(self.scheduler == SCHED_DYNAMIC):
                    self.publish_unit(unit, sched, sched_state, slots, cutlass.Int32(0))
                    sched_state.advance()  # pipeline states advance in the loop body, where the DSL carries them
                while unit < total:
                    row0, nb, expert, valid = self.decode_swapped_unit(unit, s_tiles, s_rows, s_counts)
                    next_unit = self.fetch_unit(bidx, gdim, unit, workspace, False, cutlass.Int32(0))
                    box0 = row0 // self.token_box
                    boxes = (valid + (self.token_box - 1)) // self.token_box  # wide: only the boxes with valid rows
                    for k in cutlass.range(k_tiles, unroll=1):
                        if cutlass.const_expr(self.wide):
                            mainloop.sync_object_empty.wait(state.index, state.phase)
                            bar = mainloop.producer_get_barrier(state)
                            with cute.arch.elect_one():
                                cute.arch.mbarrier_arrive_and_expect_tx(bar, self.w_bytes + boxes * self.box_bytes)
                            cute.copy(tma_atom_w, tWgW[(None, nb, k, expert)], tWsW[(None, state.index)], tma_bar_ptr=bar)
                            for j in cutlass.range_constexpr(self.token_boxes):
                                if j < boxes:
                                    cute.copy(tma_atom_t, tTgT[(None, box0 + j, k)],
                                              tTsT[(None, state.index * self.token_boxes + j)], tma_bar_ptr=bar)
                        else:
                            mainloop.producer_acquire(state)
                            bar = mainloop.producer_get_barrier(state)
                            cute.copy(tma_atom_t, tTgT[(None, box0, k)], tTsT[(None, state.index)], tma_bar_ptr=bar)
                            cute.copy(tma_atom_w, tWgW[(None, nb, k, expert)], tWsW[(None, state.index)], tma_bar_ptr=bar)
                        mainloop.producer_commit(state)
                        state.advance()
                    unit = next_unit
                    if cutlass.const_expr(self.scheduler == SCHED_DYNAMIC):
                        self.publish_unit(unit, sched, sched_state, slots, cutlass.Int32(0))
                        sched_state.advance()
                self.finish_dynamic(workspace, gdim, cutlass.Int32(0))
                mainloop.producer_tail(state)
        else:
            # ---------------------------------------------------------- consumer warpgroups
            cute.arch.setmaxregister_increase(232 if self.num_consumer_wg > 1 else 240)
            ctidx = tidx - self.threads_per_wg
            thr_mma = tiled_mma.get_slice(ctidx)
            tCrW = tiled_mma.make_fragment_A(thr_mma.partition_A(sW))  # (its K blocks; each N size partitions anew)
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_n, self.tile_m)), self.acc_dtype)
            coords = thr_mma.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m)))
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            sched_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sched_stages)
            unit = bidx
            if cutlass.const_expr(self.scheduler == SCHED_DYNAMIC):
                unit = self.read_published_unit(sched, sched_read, slots)
                sched_read.advance()
            while unit < total:
                row0, nb, expert, valid = self.decode_swapped_unit(unit, s_tiles, s_rows, s_counts)
                acc.fill(0.0)
                # wgmma N = the valid rows rounded up to token_step (decode tiles: one size, tile_m), one mainloop
                # per N (a warpgroup-uniform branch; each multiplies the first N token rows of the stage into the
                # first N / 2 registers of every atom's accumulator, which is the N-wide accumulator's order)
                size_index = (valid + (self.token_step - 1)) // self.token_step - 1
                for v in cutlass.range_constexpr(len(self.token_sizes)):
                    if size_index == v:
                        # one wgmma per K step and atom, or two above WGMMA_MAX_N rows (the first mma_tile_m rows,
                        # then the rest, whose accumulator registers follow: the same order as one wider wgmma)
                        n_rows = self.token_sizes[v]
                        parts = []
                        for first, rows in self.token_parts(n_rows):
                            mma_p = sm90_utils.make_trivial_tiled_mma(
                                self.ab_dtype, self.ab_dtype, cute.nvgpu.OperandMajorMode.K,
                                cute.nvgpu.OperandMajorMode.K, self.acc_dtype, (self.mma_wg, 1, 1),
                                tiler_mn=(64, rows),
                            )
                            thr_p = mma_p.get_slice(ctidx)
                            sT_p = cute.make_tensor(
                                cute.recast_ptr(storage.sT.data_ptr() + self.token_row_offset(t_smem_staged, first),
                                                t_smem_staged.inner, dtype=self.ab_dtype),
                                self.token_rows_layout(t_smem_staged, rows),
                            )
                            acc_p = cute.make_tensor(
                                acc.iterator + first // 2,
                                cute.make_layout(thr_p.partition_shape_C((self.tile_n, rows)), stride=acc.layout.stride),
                            )
                            mma_p.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                            parts.append((mma_p, acc_p, mma_p.make_fragment_A(thr_p.partition_A(sW)),
                                          mma_p.make_fragment_B(thr_p.partition_B(sT_p))))
                        for k in cutlass.range(k_tiles, unroll=1):
                            mainloop.consumer_wait(read_state)
                            self.issue_k_tile_parts(parts, read_state.index)
                            cute.nvgpu.warpgroup.wait_group(1)
                            if k > 0:
                                mainloop.consumer_release(release_state)
                                release_state.advance()
                            read_state.advance()
                        cute.nvgpu.warpgroup.wait_group(0)
                        if k_tiles > 0:
                            mainloop.consumer_release(release_state)
                            release_state.advance()
                if cutlass.const_expr(self.wide):
                    self.store_wide(acc, sOut, mC, expert, nb, row0, valid, bias, row_scale, ctidx)
                else:
                    self.store_swapped(acc, coords, mC, expert, nb, row0, row0 + valid, bias, row_scale)
                if cutlass.const_expr(self.scheduler == SCHED_DYNAMIC):
                    unit = self.read_published_unit(sched, sched_read, slots)
                    sched_read.advance()
                else:
                    unit = unit + gdim

    # ------------------------------------------------------------------ A_TOKEN_ROWS producer (wide tiles)
    @cute.jit
    def produce_token_rows_wide(self, tidx, warp_idx, mT, a_rows, rows_per_token, cp_atom, sT, s_tokens, tma_atom_w,
                                tWgW, tWsW, mainloop, sched, slots, s_tiles, s_rows, s_counts, workspace, bidx, gdim,
                                k_tiles, total):
        """The producer warpgroup with A_TOKEN_ROWS (wide tiles): at each unit every thread looks up the tokens of its
        rows (thread t: rows t // 8 + 16 i of the token tile, valid rows only) into s_tokens[row] (SMEM: up to 18 rows
        per thread do not fit the producer's 40 registers beside the copy loop). A row's 8 threads are lanes of one
        warp: the first writes, and a warp barrier before and after the writes orders them against the other lanes'
        reads (without it racecheck warned of intra-warp hazards); per stage all four warps wait for the
        stage to be empty, copy chunk t % 8 (16 bytes) of each of their rows' 64-column slices by cp.async into the
        swizzled stage and arrive on its full barrier when those copies landed (.noinc); warp 0 also sets the weight
        tile's transaction bytes and loads it by TMA. Rows past the unit's valid rows are not copied: their products
        land in columns the epilogue never stores. DYNAMIC: warp 0's lane 0 fetches and publishes each unit, and all
        four warps read it back from the scheduler slot."""
        row_stride = mT.layout.stride[0]
        base = mT.iterator.toint()
        thread_layout = cute.make_layout((16, 8), stride=(8, 1))
        tiled_copy = cute.make_tiled_copy_tv(cp_atom, thread_layout, cute.make_layout((1, CP_ASYNC_CHUNK)))
        tTsT = tiled_copy.get_slice(tidx).partition_D(sT)  # (CPY, tile_m / 16, tile_k / 64, stages)
        rows_per_thread = self.tile_m // 16
        slices = self.tile_k // 64
        row_in_tile = tidx // 8
        col0 = (tidx % 8) * CP_ASYNC_CHUNK
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sched_stages)
        sched_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sched_stages)
        dynamic = self.scheduler == SCHED_DYNAMIC
        unit = bidx
        if cutlass.const_expr(dynamic):
            if warp_idx == 0:
                first = self.fetch_unit(bidx, gdim, bidx, workspace, True, cutlass.Int32(0))
                self.publish_unit(first, sched, sched_state, slots, cutlass.Int32(0))
            sched_state.advance()  # (every warp keeps a copy; warp 0's is the one in use)
            unit = self.read_published_unit(sched, sched_read, slots)
            sched_read.advance()
        while unit < total:
            row0, nb, expert, valid = self.decode_swapped_unit(unit, s_tiles, s_rows, s_counts)
            next_unit = unit + gdim
            if cutlass.const_expr(dynamic):
                if warp_idx == 0:  # ask for the next unit now: the atomic's latency hides behind the loads
                    next_unit = self.fetch_unit(bidx, gdim, unit, workspace, False, cutlass.Int32(0))
            cute.arch.sync_warp()  # every lane has read the last unit's tokens
            if tidx % 8 == 0:
                for i in cutlass.range_constexpr(rows_per_thread):
                    row = row_in_tile + 16 * i
                    token = cutlass.Int32(-1)
                    if row < valid:
                        token = a_rows[row0 + row] // rows_per_token
                    s_tokens[row] = token
            cute.arch.sync_warp()  # ... and sees this unit's
            for k in cutlass.range(k_tiles, unroll=1):
                mainloop.sync_object_empty.wait(state.index, state.phase)
                if warp_idx == 0:
                    bar = mainloop.producer_get_barrier(state)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(bar, self.w_bytes)
                    cute.copy(tma_atom_w, tWgW[(None, nb, k, expert)], tWsW[(None, state.index)], tma_bar_ptr=bar)
                for i in cutlass.range_constexpr(rows_per_thread):
                    token = s_tokens[row_in_tile + 16 * i]
                    if token >= 0:
                        row_base = cutlass.Int64(token) * row_stride + k * self.tile_k + col0
                        for j in cutlass.range_constexpr(slices):
                            dst = tTsT[(None, i, j, state.index)]
                            src_ptr = cute.make_ptr(
                                self.ab_dtype, base + (row_base + j * 64) * (self.ab_dtype.width // 8),
                                cute.AddressSpace.gmem, assumed_align=16,
                            )
                            cute.copy(cp_atom, cute.make_tensor(src_ptr, cute.make_layout(dst.shape)), dst)
                cute.arch.cp_async_mbarrier_arrive_noinc(mainloop.producer_get_barrier(state))
                state.advance()
            if cutlass.const_expr(dynamic):
                if warp_idx == 0:
                    self.publish_unit(next_unit, sched, sched_state, slots, cutlass.Int32(0))
                sched_state.advance()
                unit = self.read_published_unit(sched, sched_read, slots)
                sched_read.advance()
            else:
                unit = next_unit
        if warp_idx == 0:
            self.finish_dynamic(workspace, gdim, cutlass.Int32(0))
            mainloop.producer_tail(state)

    def token_parts(self, n_rows: int):
        """(first token row, rows) of each wgmma of a unit of n_rows rows: one, or for a tile above WGMMA_MAX_N rows
        two where n_rows is above its half (mma_tile_m rows, then the rest; every part a multiple of 8 rows). Every
        N of such a tile then keeps its accumulators in the same two register ranges (from 0 and from
        mma_tile_m / 2): one wgmma across the boundary made ptxas serialize the wgmma (C7511)."""
        if n_rows <= self.mma_tile_m:
            return ((0, n_rows),)
        return ((0, self.mma_tile_m), (self.mma_tile_m, n_rows - self.mma_tile_m))

    def token_row_offset(self, t_smem_staged, first_row: int) -> int:
        """Elements from the token tile's start to its row first_row (a multiple of 8: a whole swizzle atom, so
        the view keeps the swizzle's phase)."""
        (atom, _groups), _k, _stages = t_smem_staged.outer.shape
        (_s_atom, s_groups), _ks, _ss = t_smem_staged.outer.stride
        return (first_row // atom) * s_groups

    @cute.jit
    def issue_k_tile_parts(self, parts, stage):
        """The MMAs of one K tile (SMEM stage `stage`) of every part as one committed wgmma group, fenced first
        (see Sm90GroupedGemmKernel.issue_k_tile)."""
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(parts[0][2], mode=[2])):
            coord = (None, None, kb, stage)
            for mma_p, acc_p, tCrW_p, tCrT_p in parts:
                cute.gemm(mma_p, acc_p, tCrW_p[coord], tCrT_p[coord], acc_p)
        cute.nvgpu.warpgroup.commit_group()

    def token_rows_layout(self, t_smem_staged, n_rows: int):
        """The first n_rows rows of every stage of the token tile (outer layout; same swizzle): the staged
        tile is ((8, tile_m / 8), K, stages) 8-row atoms, so keep n_rows / 8 of them and the strides."""
        outer = t_smem_staged.outer
        (atom, groups), k_mode, stage_mode = outer.shape
        (s_atom, s_groups), k_stride, stage_stride = outer.stride
        return cute.make_layout(((atom, n_rows // atom), k_mode, stage_mode),
                                stride=((s_atom, s_groups), k_stride, stage_stride))

    # ------------------------------------------------------------------ epilogue
    @cute.jit
    def store_wide(self, acc, sOut, mC, expert, nb, row0, valid, bias, row_scale, ctidx):
        """Wide units: acc[weight row w, token t] -> C[row0 + t, column of w] for t < valid.

        Consumer warp c holds 16 weight rows of each of its warpgroup's wgmma atoms (atom a: rows 64 * W * a +
        16 * c + lane / 4 and + 8, W warpgroups) for tokens 2 * (lane % 4) + j of every 8-token group g, at
        accumulator index j + 2h + 4g + (tile_m / 2) a. The epilogue math runs in registers first, so that its
        global loads (bias, row scale) all issue before any store; then per epi_rows tokens the values go to SMEM
        [token][output column] by stmatrix.trans (an 8x8 fragment of 8 weight rows x 8 tokens is stored as 8
        token rows of 8 contiguous columns) and from there to global memory in 16-byte row pieces, only the rows
        of valid tokens (the rows after them belong to the padding or to the next expert). A partial last n-block
        (N no multiple of tile_n) reads the bias of its last weight row for the rows past N and stores none of their
        columns."""
        warp = ctidx // 32
        lane = ctidx % 32
        quad = lane % 4
        n0 = nb * self.tile_n
        out0 = nb * self.out_tile_n
        last = row0 + valid - 1
        groups = self.tile_m // 8
        atoms = cute.size(acc, mode=[1])  # wgmma atoms (of 64 weight rows) per warpgroup
        atom_rows = 64 * self.num_consumer_wg
        per_group = 2 if self.gated else 4  # output values per thread per 8-token group and atom
        vals = cute.make_rmem_tensor((atoms * groups * per_group,), self.c_dtype)
        scales = [cutlass.Float32(1.0)] * (2 * groups)
        if cutlass.const_expr(self.has_row_scale):
            for g in cutlass.range_constexpr(groups):
                for j in cutlass.range_constexpr(2):
                    scales[j + 2 * g] = row_scale[cutlass.min(row0 + 8 * g + 2 * quad + j, last)]
        for a in cutlass.range_constexpr(atoms):
            wrow = atom_rows * a + warp * 16 + lane // 4  # this lane's weight row (h = 0); h = 1 is wrow + 8
            base = a * groups * per_group
            acc0 = a * (self.tile_m // 2)
            if cutlass.const_expr(self.gated):
                b_gate = cutlass.Float32(0.0)
                b_up = cutlass.Float32(0.0)
                if cutlass.const_expr(self.has_bias):
                    b_gate = bias[expert, cutlass.min(n0 + wrow, self.n - 1)]
                    b_up = bias[expert, cutlass.min(n0 + wrow + 8, self.n - 1)]
                for g in cutlass.range_constexpr(groups):
                    for j in cutlass.range_constexpr(2):
                        gate = acc[acc0 + j + 4 * g] + b_gate
                        up = acc[acc0 + j + 2 + 4 * g] + b_up
                        vals[base + j + 2 * g] = self.activation(gate, up).to(self.c_dtype)
            else:
                b_h = [cutlass.Float32(0.0), cutlass.Float32(0.0)]
                if cutlass.const_expr(self.has_bias):
                    b_h = [bias[expert, cutlass.min(n0 + wrow, self.n - 1)],
                           bias[expert, cutlass.min(n0 + wrow + 8, self.n - 1)]]
                for g in cutlass.range_constexpr(groups):
                    for j in cutlass.range_constexpr(2):
                        for h in cutlass.range_constexpr(2):
                            value = (acc[acc0 + j + 2 * h + 4 * g] + b_h[h]) * scales[j + 2 * g]
                            vals[base + j + 2 * h + 4 * g] = value.to(self.c_dtype)
        pieces = self.out_tile_n // 8  # 16-byte pieces per output row of the unit
        out_n = self.n // 2 if cutlass.const_expr(self.gated) else self.n  # columns of C
        s8 = cute.zipped_divide(sOut, (1, 8))
        g8 = cute.zipped_divide(mC, (1, 8))
        piece = cute.make_rmem_tensor((8,), self.c_dtype)  # one stmatrix.x4's values
        row_piece = cute.make_rmem_tensor((1, 8), self.c_dtype)  # 16 bytes of one output row
        chunk_groups = self.epi_rows // 8
        frag = lane // 8
        for ch in cutlass.range_constexpr(self.tile_m // self.epi_rows):
            if ch * self.epi_rows < valid:  # CTA-uniform
                # registers -> SMEM: one stmatrix.x4.trans stores four 8x8 fragments; lane 8i + r gives the
                # address of token row r of fragment i
                for a in cutlass.range_constexpr(atoms):
                    base = a * groups * per_group
                    for q in cutlass.range_constexpr(chunk_groups * per_group // 8):  # 8 values per stmatrix.x4
                        if cutlass.const_expr(self.gated):  # fragments: 8 output columns x token groups g0 .. g0 + 3
                            g0 = ch * chunk_groups + 4 * q
                            for i in cutlass.range_constexpr(4):
                                for j in cutlass.range_constexpr(2):
                                    piece[2 * i + j] = vals[base + j + 2 * (g0 + i)]
                            row = 8 * (4 * q + frag) + lane % 8
                            col = (atom_rows * a) // 2 + 8 * warp
                        else:  # fragments: (h = 0, g0), (h = 1, g0), (h = 0, g0 + 1), (h = 1, g0 + 1)
                            g0 = ch * chunk_groups + 2 * q
                            for i in cutlass.range_constexpr(4):
                                for j in cutlass.range_constexpr(2):
                                    piece[2 * i + j] = vals[base + j + 2 * (i % 2) + 4 * (g0 + i // 2)]
                            row = 8 * (2 * q + frag // 2) + lane % 8
                            col = atom_rows * a + 16 * warp + 8 * (frag % 2)
                        prims.stmatrix(sOut.iterator + row * self.epi_pitch + col, piece.load(), prims.MMALayout.COL)
                self.epi_barrier.arrive_and_wait()
                # SMEM -> global, 16 bytes per thread and step, rows of valid tokens only
                for i in cutlass.range_constexpr(self.epi_rows * pieces // self.num_consumer_threads):
                    v = ctidx + self.num_consumer_threads * i
                    r = v // pieces
                    p = v % pieces
                    if cutlass.const_expr(self.n % self.tile_n != 0):  # a partial last n-block: columns < N only
                        if ch * self.epi_rows + r < valid and out0 + 8 * p < out_n:
                            cute.autovec_copy(s8[(None, (r, p))], row_piece)
                            cute.autovec_copy(row_piece, g8[(None, (row0 + ch * self.epi_rows + r, out0 // 8 + p))])
                    else:
                        if ch * self.epi_rows + r < valid:
                            cute.autovec_copy(s8[(None, (r, p))], row_piece)
                            cute.autovec_copy(row_piece, g8[(None, (row0 + ch * self.epi_rows + r, out0 // 8 + p))])
                self.epi_barrier.arrive_and_wait()

    @cute.jit
    def store_swapped(self, acc, coords, mC, expert, nb, row0, end_row, bias, row_scale):
        """acc[weight row w, token t] -> C[row0 + t, column of w]; rows at or past end_row are padding."""
        n0 = nb * self.tile_n
        if cutlass.const_expr(self.gated):
            # wgmma C layout per thread, mode 0 = (2 token columns, rows r / r + 8, tile_m / 8 groups):
            # weight rows r (gate) and r + 8 (up) of one 16-row chunk are one output column
            out0 = nb * self.out_tile_n
            for mi in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                for g in cutlass.range_constexpr(self.tile_m // 8):
                    for j in cutlass.range_constexpr(2):
                        w, t = coords[(j + 4 * g, mi, 0)]
                        row = row0 + t
                        if row < end_row:
                            gate = acc[(j + 4 * g, mi, 0)]
                            up = acc[(j + 2 + 4 * g, mi, 0)]
                            if cutlass.const_expr(self.has_bias):
                                gate = gate + bias[expert, n0 + w]
                                up = up + bias[expert, n0 + w + 8]
                            value = self.activation(gate, up)
                            mC[row, out0 + (w // 16) * 8 + w % 16] = value.to(self.c_dtype)
        else:
            for i in cutlass.range_constexpr(cute.size(acc)):
                w, t = coords[i]
                row = row0 + t
                if row < end_row:
                    value = acc[i]
                    if cutlass.const_expr(self.has_bias):
                        value = value + bias[expert, n0 + w]
                    if cutlass.const_expr(self.has_row_scale):
                        value = value * row_scale[row]
                    mC[row, n0 + w] = value.to(self.c_dtype)
