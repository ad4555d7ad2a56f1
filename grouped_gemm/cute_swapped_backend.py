"""Hopper (sm_90a) grouped GEMM for few rows per expert (decode): swapped operands, in CuTe DSL.

Imports `cutlass` at the top: import it lazily (sm90_grouped_gemm.py does), never from a package __init__.

Same problem and metadata as cute_backend.py (A [M, K] rows in padded expert order, B [E, N, K], C [M,
N_out], row_offsets / counts on the device, symbolic M), for the case where each expert has only a few
rows. A 128-row wgmma tile would then multiply mostly padding, and its MMA time per weight byte is about
the time HBM needs to deliver that byte. Here the operands swap roles: the expert's weight rows are
wgmma's M side (64 rows per instruction, tile_n per unit) and the token rows are its N side (tile_m =
8..64 per unit), so a unit multiplies C^T[tile_n, tile_m] = B_e[tile_n, K] @ A[tile_m, K]^T and the
tensor cores idle while the weights stream at HBM bandwidth.

Work units: (token tile, n-block). Token tiles are counted per expert, ceil(counts[e] / tile_m), so tiles
of padding rows do not exist (the 128-row padding of the dispatch would otherwise make most units empty);
every CTA builds that prefix sum in SMEM at start (one warp, shuffle scan). Raster ALONG_M puts the
token tiles of one n-block next to each other, so experts with several tiles share the weight tile in L2.

Warp roles (256 threads):
- warpgroup 0, warp 0: TMA producer (per unit: the K tiles of the token tile and of the weight tile into
  the next free stage); DYNAMIC: fetches units from the global counter as in cute_backend.py.
- warpgroup 1: the consumer. wgmma with the weight tile as A (tile_n / 64 instructions per k-block) and
  the token tile as B, one wgmma group in flight; then the epilogue from registers straight to global
  memory: each thread holds weight rows r and r + 8 of every 16, which the w13 prepack (8 gate rows, then
  the 8 matching up rows) makes a gate / up pair of one output column, so the gated activation needs no
  data exchange. Rows past the expert's count (padding) are not stored.
Pipelines: mainloop (PipelineTmaAsync, `stages` deep) and DYNAMIC's scheduler slot, as in cute_backend.py.
There is no SMEM epilogue stage: at decode sizes the output is a few KB per unit. The producer and consumer
loops mirror cute_backend.py's in the kernel body on purpose: a pipeline state advanced inside a helper
is not carried back through the DSL's loop (the v1 hang recorded in docs/perf-notes-sm90.md).

Limits: cluster 1 (no multicast: a unit holds one expert's few rows), bf16/fp16, K % 8 == 0, N % tile_n
== 0, tile_n a multiple of 64 (<= 256), tile_m in {8, 16, 32, 64} dividing the row_offsets alignment.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from .cute_backend import CONSUMERS_COOPERATIVE, SCHED_DYNAMIC, RASTER_N, Sm90GroupedGemmKernel


class Sm90SwappedGroupedGemmKernel(Sm90GroupedGemmKernel):
    """Weights as wgmma's M side, tokens as its N side; one producer warp, one consumer warpgroup."""

    def __init__(self, *, tile_m, tile_n, tile_k, stages, epilogue, has_bias, has_row_scale, num_experts, scheduler,
                 raster, num_sms):
        super().__init__(
            tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, stages=stages, cluster_m=1, epilogue=epilogue,
            has_bias=has_bias, has_row_scale=has_row_scale, num_experts=num_experts, scheduler=scheduler,
            raster=raster, num_sms=num_sms, consumers=CONSUMERS_COOPERATIVE,
        )
        self.num_consumer_wg = 1
        self.mma_wg = 1
        self.threads = 2 * self.threads_per_wg
        self.num_consumer_threads = self.threads_per_wg
        self.scan_per_lane = (num_experts + 31) // 32  # experts per lane in the token-tile prefix sum

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
        workspace: cute.Tensor,  # [4] int32: dynamic scheduler counter, done count
        pair_threshold: cutlass.Int32,  # unused (no pairs); kept so every sm90 kernel has one signature
        stream,
    ):
        self.ab_dtype = a.element_type
        self.c_dtype = c.element_type
        self.n_blocks = b.shape[1] // self.tile_n
        kmajor = cute.nvgpu.warpgroup.OperandMajorMode.K
        # MMA problem per unit: M = weight rows (tile_n), N = token rows (tile_m)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, kmajor, kmajor, self.acc_dtype, (1, 1, 1), tiler_mn=(64, self.tile_m)
        )
        mma_mnk = (self.tile_n, self.tile_m, self.tile_k)
        w_smem_staged = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, mma_mnk, self.ab_dtype, self.stages)
        t_smem_staged = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, mma_mnk, self.ab_dtype, self.stages)
        b_nke = cute.make_tensor(b.iterator, cute.select(b.layout, mode=[1, 2, 0]))  # expert = batch mode
        t_smem_one = cute.slice_(t_smem_staged, (None, None, 0))
        w_smem_one = cute.slice_(w_smem_staged, (None, None, 0))
        tma_atom_t, tma_t = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), a, t_smem_one, (self.tile_m, self.tile_k)
        )
        tma_atom_w, tma_w = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), b_nke, w_smem_one, (self.tile_n, self.tile_k)
        )
        self.tma_bytes = cute.size_in_bytes(self.ab_dtype, t_smem_one) + cute.size_in_bytes(self.ab_dtype, w_smem_one)

        @cute.struct
        class SharedStorage:
            mainloop_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sched_barriers: cute.struct.MemRange[cutlass.Int64, self.sched_stages * 2]
            sched_slots: cute.struct.MemRange[cutlass.Int32, self.sched_stages * 4]
            expert_rows: cute.struct.MemRange[cutlass.Int32, self.num_experts + 1]
            expert_counts: cute.struct.MemRange[cutlass.Int32, self.num_experts]
            expert_tiles: cute.struct.MemRange[cutlass.Int32, self.num_experts + 1]
            sT: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(t_smem_staged)], self.buffer_align_bytes]
            sW: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(w_smem_staged)], self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_atom_t, tma_t, tma_atom_w, tma_w, c, row_offsets, counts, bias, row_scale, workspace,
            t_smem_staged, w_smem_staged, self.tiled_mma,
        ).launch(grid=(self.num_sms, 1, 1), block=(self.threads, 1, 1), min_blocks_per_mp=1, stream=stream)

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
    def decode_swapped_unit(self, unit: cutlass.Int32, s_tiles: cute.Tensor, s_rows: cute.Tensor):
        """unit -> (token-tile block index in A, n_block, expert); every token tile holds a valid row."""
        total_tiles = s_tiles[self.num_experts]
        tile = unit % total_tiles
        nb = unit // total_tiles
        if cutlass.const_expr(self.raster == RASTER_N):
            nb = unit % self.n_blocks
            tile = unit // self.n_blocks
        expert = self.expert_of_row(s_tiles, tile)  # largest e with s_tiles[e] <= tile: a non-empty expert
        m_block = s_rows[expert] // self.tile_m + (tile - s_tiles[expert])
        return m_block, nb, expert

    # ------------------------------------------------------------------ the kernel
    @cute.kernel
    def kernel(
        self,
        tma_atom_t: cute.CopyAtom,
        mT: cute.Tensor,
        tma_atom_w: cute.CopyAtom,
        mW: cute.Tensor,
        mC: cute.Tensor,
        row_offsets: cute.Tensor,
        counts: cute.Tensor,
        bias: cute.Tensor,
        row_scale: cute.Tensor,
        workspace: cute.Tensor,
        t_smem_staged: cute.ComposedLayout,
        w_smem_staged: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_t)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_w)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mainloop_barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),  # the consumer's 4 warps
            tx_count=self.tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        sched = pipeline.PipelineAsync.create(
            barrier_storage=storage.sched_barriers.data_ptr(),
            num_stages=self.sched_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sT = storage.sT.get_tensor(t_smem_staged.outer, swizzle=t_smem_staged.inner)
        sW = storage.sW.get_tensor(w_smem_staged.outer, swizzle=w_smem_staged.inner)
        slots = storage.sched_slots.get_tensor(cute.make_layout((4, self.sched_stages)))
        s_rows = storage.expert_rows.get_tensor(cute.make_layout(self.num_experts + 1))
        s_counts = storage.expert_counts.get_tensor(cute.make_layout(self.num_experts))
        s_tiles = storage.expert_tiles.get_tensor(cute.make_layout(self.num_experts + 1))
        for i in cutlass.range(tidx, self.num_experts + 1, self.threads, unroll=1):
            s_rows[i] = row_offsets[i]
            if i < self.num_experts:
                s_counts[i] = counts[i]
        if warp_idx == 1:
            self.scan_token_tiles(counts, s_tiles)
        cute.arch.sync_threads()

        # (bM, bK, RestM, RestK) token tiles, (bN, bK, RestN, RestK, E) weight tiles
        gT = cute.local_tile(mT, (self.tile_m, self.tile_k), (None, None))
        gW = cute.local_tile(mW, (self.tile_n, self.tile_k), (None, None, None))
        tTsT, tTgT = cute.nvgpu.cpasync.tma_partition(
            tma_atom_t, 0, cute.make_layout(1), cute.group_modes(sT, 0, 2), cute.group_modes(gT, 0, 2)
        )
        tWsW, tWgW = cute.nvgpu.cpasync.tma_partition(
            tma_atom_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2)
        )
        k_tiles = cute.size(gT, mode=[3])
        total = s_tiles[self.num_experts] * self.n_blocks

        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if wg_idx == 0:
            # ---------------------------------------------------------- producer warp
            cute.arch.setmaxregister_decrease(40)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sched_stages)
                unit = self.fetch_unit(bidx, gdim, bidx, workspace, True, cutlass.Int32(0))
                if cutlass.const_expr(self.scheduler == SCHED_DYNAMIC):
                    self.publish_unit(unit, sched, sched_state, slots, cutlass.Int32(0))
                    sched_state.advance()  # pipeline states advance in the loop body, where the DSL carries them
                while unit < total:
                    m_block, nb, expert = self.decode_swapped_unit(unit, s_tiles, s_rows)
                    next_unit = self.fetch_unit(bidx, gdim, unit, workspace, False, cutlass.Int32(0))
                    for k in cutlass.range(k_tiles, unroll=1):
                        mainloop.producer_acquire(state)
                        bar = mainloop.producer_get_barrier(state)
                        cute.copy(tma_atom_t, tTgT[(None, m_block, k)], tTsT[(None, state.index)], tma_bar_ptr=bar)
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
            # ---------------------------------------------------------- consumer warpgroup
            cute.arch.setmaxregister_increase(240)
            ctidx = tidx - self.threads_per_wg
            thr_mma = tiled_mma.get_slice(ctidx)
            tCsW = thr_mma.partition_A(sW)
            tCsT = thr_mma.partition_B(sT)
            tCrW = tiled_mma.make_fragment_A(tCsW)
            tCrT = tiled_mma.make_fragment_B(tCsT)
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_n, self.tile_m)), self.acc_dtype)
            coords = thr_mma.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m)))
            num_k_blocks = cute.size(tCrW, mode=[2])
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            sched_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sched_stages)
            unit = bidx
            if cutlass.const_expr(self.scheduler == SCHED_DYNAMIC):
                unit = self.read_published_unit(sched, sched_read, slots)
                sched_read.advance()
            while unit < total:
                m_block, nb, expert = self.decode_swapped_unit(unit, s_tiles, s_rows)
                acc.fill(0.0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.fence()
                for k in cutlass.range(k_tiles, unroll=1):
                    mainloop.consumer_wait(read_state)
                    for kb in cutlass.range_constexpr(num_k_blocks):
                        coord = (None, None, kb, read_state.index)
                        cute.gemm(tiled_mma, acc, tCrW[coord], tCrT[coord], acc)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(1)
                    if k > 0:
                        mainloop.consumer_release(release_state)
                        release_state.advance()
                    read_state.advance()
                cute.nvgpu.warpgroup.wait_group(0)
                if k_tiles > 0:
                    mainloop.consumer_release(release_state)
                    release_state.advance()
                end_row = s_rows[expert] + s_counts[expert]
                self.store_swapped(acc, coords, mC, expert, nb, m_block * self.tile_m, end_row, bias, row_scale)
                if cutlass.const_expr(self.scheduler == SCHED_DYNAMIC):
                    unit = self.read_published_unit(sched, sched_read, slots)
                    sched_read.advance()
                else:
                    unit = unit + gdim

    # ------------------------------------------------------------------ epilogue
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
