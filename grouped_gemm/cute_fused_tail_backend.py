"""Hopper (sm_90a) grouped GEMM whose expert tails ride on other m-blocks' weight passes (FUSE_TAIL, SPLIT_TAIL), CuTe DSL.

Same problem, metadata, scheduling and rasters as cute_backend.py (SINGLE units, cluster 1, gathered A in padded
expert order, row_offsets multiples of 128). What differs is the unit of work of an expert whose last m-block holds
at most 64 valid rows (its "tail"): cute_backend.py multiplies that m-block as a tile of its own, so the weight tile
streams through L2 and SMEM once more for up to 64 rows (with PaddingRows.SKIP one warpgroup idles, but the weight
pass remains). Here other units of the expert take the tail's 64 rows, and the tail's own unit is empty (nothing
loaded, multiplied or stored):
- PaddingRows.FUSE_TAIL (tail_parts 1): the m-block before the tail takes all of its columns: 192 rows on one
  pass of the weight tile, a unit 1.5x as long as the expert's others;
- PaddingRows.SPLIT_TAIL (tail_parts 2): an expert of exactly three m-blocks (257-320 rows: 256 rows per expert
  give about half the experts that) has the tail's columns split between its first two m-blocks, each then 1.25x
  a plain unit, so that the CTAs sharing the expert's weight tiles keep pace with each other.

Warp roles (one CTA, 128 threads per warpgroup):
- warpgroup 0, warp 0: TMA producer. Per unit: the B tile (tile_n x tile_k) and, as 64-row boxes, only the A rows the
  unit multiplies (`unit_boxes`: boxes that hold valid rows, 3 for a fused unit, 0 for a fused tail's own unit),
  with the stage's transaction bytes set per unit.
- consumer warpgroups 1 and 2 (w = 0, 1), wgmma with fp32 accumulators:
  - every unit: rows [64 w, 64 w + 64) of the m-block x all tile_n columns (m64 n=tile_n), when box w holds valid
    rows (else the warpgroup only waits on and releases each stage, as PaddingRows.SKIP);
  - a fused unit also: the tail's 64 rows x one slice of the weight tile's columns (tile_n / (2 tail_parts) of them:
    slice first_slice + w, see `unit_boxes`), in the same wgmma group, so the warpgroups split the tail evenly.
  Up to 192 accumulator registers per thread (128 + 64, SPLIT_TAIL 128 + 32) under setmaxnreg 232. Fused and plain units run separate K loops
  (a warpgroup-uniform branch outside them: an MMA branch inside the K loop made ptxas serialize the wgmma, C7520).
  Epilogue after the mainloop (EpilogueStore.AFTER_MAINLOOP): each warpgroup stores its own 64-row tiles (its
  m-block rows; in a fused unit also its slice of the tail rows' columns) through its own named barrier and SMEM
  buffers, stmatrix -> TMA store of 64-row sub-tiles (32 or 16 columns: what divides both tiles) by the
  warpgroup's first warp. The gated epilogue writes its
  outputs over the accumulator's first registers (no second register tile).
Pipelines: mainloop PipelineTmaAsync (`stages` deep; 56 KB a stage at 128x256x64: 3 stages; 7 at tile_k 32), scheduler
PipelineAsync (DYNAMIC), epilogue PipelineTmaStore per warpgroup: as in cute_backend.py.

Limits: those of cute_backend.py's SINGLE COOPERATIVE kernel with tile_m 128, plus tile_k 32 or 64 (the swizzle
width: a 64-row box of a K-major tile is then contiguous in its stage) and AFTER_MAINLOOP stores (the accumulators
leave no registers for a held tile); dependent_launch STREAM_ORDER or PROGRAMMATIC (the wait of cute_backend.py, no
weight prefetch). Three consumer warpgroups of one 64 x 256 accumulator each do not compile: a
512-thread CTA gets 128 registers per thread and one m64n256k16 wgmma needs 154.

Measured on the H200 (results/fuse-tail-h200-2026-12-01/). FUSE_TAIL takes 1.02-1.13x the time of the regular
kernel with the same stores at 128-512 rows per expert. Its 3 stages cost 1.5-8%. Its units of unequal length let
the CTAs that share a weight tile drift apart, so the tile is read from DRAM again (deepseek-v3 T=8192 GEMM1: 28.6 GB
against 22.8). SPLIT_TAIL's equal units read 25.7 GB there and still take 1.11x. Both selectable, not defaults.
Output slices narrower than 16 columns (8-column store sub-tiles) were wrong on the H200; can_implement refuses them.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from .cute_backend import PADDING_SKIP, SCHED_DYNAMIC, Sm90GroupedGemmKernel

BOX_ROWS = 64  # rows of one TMA box of A (a warpgroup's rows)
FUSED_BOXES = 3  # A boxes of a fused unit: the m-block's two and the tail's first


class Sm90FusedTailGroupedGemmKernel(Sm90GroupedGemmKernel):
    """One compiled instance = one static configuration (see the module docstring)."""

    def __init__(self, *, tail_parts: int, **kwargs):
        # the base kernel's settings (a warpgroup with no valid rows skips its MMAs here too; unit_boxes decides)
        super().__init__(**kwargs, padding_rows=PADDING_SKIP)
        if self.tile_m != 128 or self.tile_k not in (32, 64) or self.cluster_m != 1 or self.pingpong or self.token_rows:
            raise ValueError("fused tails: SINGLE COOPERATIVE 128-row tiles, tile_k 32 or 64, gathered A")
        if tail_parts not in (1, 2):
            raise ValueError(f"tail_parts: expected 1 (FUSE_TAIL) or 2 (SPLIT_TAIL), got {tail_parts}")
        self.tail_parts = tail_parts
        # the weight tile as 2 * tail_parts slices: the tail columns of one warpgroup of one fused unit
        self.tail_slices = 2 * tail_parts
        self.slice_n = self.tile_n // self.tail_slices
        self.out_slice_n = self.out_tile_n // self.tail_slices

    # ------------------------------------------------------------------ host side (trace time)
    @cute.jit
    def launch(self, a, a_rows, rows_per_token, b, c, row_offsets, counts, bias, row_scale, workspace, pair_threshold,
               num_ctas, stream):
        """Trace-time set-up (one-warpgroup MMA atoms, box layouts, copy atoms, shared storage) and the launch."""
        self.ab_dtype = a.element_type
        self.n = b.shape[1]
        self.n_blocks = (self.n + self.tile_n - 1) // self.tile_n
        self.c_dtype = c.element_type
        kmajor = cute.nvgpu.OperandMajorMode.K

        def one_warpgroup_mma(columns):
            return sm90_utils.make_trivial_tiled_mma(self.ab_dtype, self.ab_dtype, kmajor, kmajor, self.acc_dtype,
                                                     (1, 1, 1), tiler_mn=(BOX_ROWS, columns))

        main_mma = one_warpgroup_mma(self.tile_n)  # a warpgroup's 64 m-block rows x the whole weight tile
        tail_mma = one_warpgroup_mma(self.slice_n)  # the tail's 64 rows x one slice of the weight tile
        out_mma = one_warpgroup_mma(self.out_tile_n)  # their output tiles (the epilogue's register layouts)
        out_tail_mma = one_warpgroup_mma(self.out_slice_n)
        # sub-tiles that divide both output tiles (gpt-oss GEMM1: 96 and 48 columns); can_implement keeps them >= 16
        self.epi_tile = (BOX_ROWS, 32 if self.out_slice_n % 32 == 0 else 16)
        a_layout = LayoutEnum.from_tensor(a)
        self.c_layout = LayoutEnum.from_tensor(c)
        # A as 64-row boxes (stage s, box j = box-stage s * FUSED_BOXES + j) and B as its whole tile and as slices
        # (stage s, slice h = s * tail_slices + h), over the same bytes: a K-major tile whose tile_k is its swizzle width
        # (tile_k 64: 128B, 32: 64B) is a stack of 8-row atoms, so row boxes tile it exactly
        a_box_staged = sm90_utils.make_smem_layout_a(a_layout, (BOX_ROWS, self.tile_n, self.tile_k), self.ab_dtype,
                                                     self.stages * FUSED_BOXES)
        b_smem_staged = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BOX_ROWS, self.tile_n, self.tile_k),
                                                      self.ab_dtype, self.stages)
        b_slice_staged = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BOX_ROWS, self.slice_n, self.tile_k),
                                                      self.ab_dtype, self.stages * self.tail_slices)
        epi_smem_staged = sm90_utils.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile,
                                                          self.epi_stages * self.num_consumer_wg)
        b_nke = cute.make_tensor(b.iterator, cute.select(b.layout, mode=[1, 2, 0]))  # expert = batch mode
        a_box_one = cute.slice_(a_box_staged, (None, None, 0))
        b_smem_one = cute.slice_(b_smem_staged, (None, None, 0))
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), a, a_box_one, (BOX_ROWS, self.tile_k)
        )
        tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), b_nke, b_smem_one, (self.tile_n, self.tile_k)
        )
        tma_atom_c, tma_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), c, cute.slice_(epi_smem_staged, (None, None, 0)),
            self.epi_tile,
        )
        self.box_bytes = cute.size_in_bytes(self.ab_dtype, a_box_one)
        self.b_bytes = cute.size_in_bytes(self.ab_dtype, b_smem_one)

        self.shared_storage = self.make_shared_storage(a_box_staged, b_smem_staged, epi_smem_staged)
        self.fused_kernel(
            tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_c, tma_c, row_offsets, counts, bias, row_scale, workspace,
            a_box_staged, b_smem_staged, b_slice_staged, epi_smem_staged, main_mma, tail_mma, out_mma, out_tail_mma,
        ).launch(
            grid=(num_ctas, 1, 1),
            block=(self.threads, 1, 1),
            cluster=(1, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.programmatic,
        )

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def unit_boxes(self, m_block, expert, row_offsets, counts):
        """(boxes, first slice, tail box) of unit (m_block, expert).

        boxes: the 64-row boxes of A it multiplies. Those holding valid rows from the m-block's first row (at most
        2); FUSED_BOXES for a unit that also takes the expert's tail (its last m-block, at most 64 valid rows); 0 for
        the tail's own m-block, whose rows are multiplied elsewhere. FUSE_TAIL (tail_parts 1): the m-block before
        the tail takes all of it, where the expert has 2+ m-blocks. SPLIT_TAIL (2): an expert of exactly 3 m-blocks
        has the tail's columns split between its first two, which then take the same time; others do not fuse.
        first slice: the weight tile slice (of tail_slices) of warpgroup 0's tail columns; warpgroup w takes +w.
        tail box: the 64-row box index (of A and C) of the tail's rows."""
        first = row_offsets[expert] // self.tile_m
        block = m_block - first
        blocks = (row_offsets[expert + 1] - row_offsets[expert]) // self.tile_m
        valid = counts[expert] - block * self.tile_m  # valid rows from this m-block's first row on
        tail = counts[expert] - (blocks - 1) * self.tile_m  # valid rows of the expert's last m-block
        boxes = cutlass.min(cutlass.max((valid + BOX_ROWS - 1) // BOX_ROWS, 0), 2)
        first_slice = cutlass.Int32(0)
        fuses = blocks >= 2 and tail > 0 and tail <= BOX_ROWS
        if cutlass.const_expr(self.tail_parts == 2):
            fuses = blocks == 3 and tail > 0 and tail <= BOX_ROWS
        if fuses:
            if block == blocks - 1:
                boxes = cutlass.Int32(0)
            elif block >= blocks - 1 - self.tail_parts:
                boxes = cutlass.Int32(FUSED_BOXES)
                first_slice = (block - (blocks - 1 - self.tail_parts)) * 2
        return boxes, first_slice, (first + blocks - 1) * 2

    # ------------------------------------------------------------------ the kernel
    @cute.kernel
    def fused_kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC: cute.Tensor,
        row_offsets: cute.Tensor,
        counts: cute.Tensor,
        bias: cute.Tensor,
        row_scale: cute.Tensor,
        workspace: cute.Tensor,
        a_box_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        b_slice_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout,
        main_mma: cute.TiledMma,
        tail_mma: cute.TiledMma,
        out_mma: cute.TiledMma,
        out_tail_mma: cute.TiledMma,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_c)
        rank = cutlass.Int32(0)  # cluster 1: the base helpers' rank and (unused) pair threshold
        pair_threshold = cutlass.Int32(0)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # (the producer sets each unit's transaction bytes itself)
        mainloop, sched = self.single_cta_pipelines(storage, self.b_bytes + FUSED_BOXES * self.box_bytes)

        sA = storage.sA.get_tensor(a_box_staged.outer, swizzle=a_box_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sB_slice = storage.sB.get_tensor(b_slice_staged.outer, swizzle=b_slice_staged.inner)
        sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)
        slots = storage.sched_slots.get_tensor(cute.make_layout((4, self.sched_stages)))
        self.await_previous_kernel()
        s_rows, s_counts = self.copy_metadata(storage, row_offsets, counts, tidx)
        cute.arch.sync_threads()

        # (box, bK, RestBoxes, RestK), (bN, bK, RestN, RestK, E); C in 64-row tiles of the whole and of one slice of
        # the output columns
        gA = cute.local_tile(mA, (BOX_ROWS, self.tile_k), (None, None))
        gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None, None))
        gC = cute.local_tile(mC, (BOX_ROWS, self.out_tile_n), (None, None))
        gC_slice = cute.local_tile(mC, (BOX_ROWS, self.out_slice_n), (None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        k_tiles = cute.size(gA, mode=[3])
        num_clusters = gdim

        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if wg_idx == 0:
            # ---------------------------------------------------------- producer warp
            cute.arch.setmaxregister_decrease(40)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sched_stages)
                unit = self.fetch_unit(bidx, num_clusters, bidx, workspace, True, rank)
                if cutlass.const_expr(self.scheduler == SCHED_DYNAMIC):
                    unit = self.publish_unit(unit, sched, sched_state, slots, rank)
                    sched_state.advance()  # pipeline states advance in the loop body, where the DSL carries them
                total = self.total_units(s_rows)
                while unit < total:
                    m_block, nb, expert, _, _, _ = self.decode_unit(unit, s_rows, s_counts, pair_threshold, rank)
                    next_unit = self.fetch_unit(bidx, num_clusters, unit, workspace, False, rank)
                    boxes, _, tail_box = self.unit_boxes(m_block, expert, s_rows, s_counts)
                    load_tiles = k_tiles if boxes > 0 else 0  # a fused tail's own unit loads nothing
                    for k in cutlass.range(load_tiles, unroll=1):
                        mainloop.sync_object_empty.wait(state.index, state.phase)
                        bar = mainloop.producer_get_barrier(state)
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(bar, self.b_bytes + boxes * self.box_bytes)
                        cute.copy(tma_atom_b, tBgB[(None, nb, k, expert)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                        for j in cutlass.range_constexpr(FUSED_BOXES - 1):  # the m-block's own boxes
                            if j < boxes:
                                cute.copy(tma_atom_a, tAgA[(None, m_block * 2 + j, k)],
                                          tAsA[(None, state.index * FUSED_BOXES + j)], tma_bar_ptr=bar)
                        if boxes == FUSED_BOXES:  # the tail's rows
                            cute.copy(tma_atom_a, tAgA[(None, tail_box, k)],
                                      tAsA[(None, state.index * FUSED_BOXES + FUSED_BOXES - 1)], tma_bar_ptr=bar)
                        mainloop.producer_commit(state)
                        state.advance()
                    unit = next_unit
                    if cutlass.const_expr(self.scheduler == SCHED_DYNAMIC):
                        unit = self.publish_unit(unit, sched, sched_state, slots, rank)
                        sched_state.advance()
                self.finish_dynamic(workspace, num_clusters, rank)
                mainloop.producer_tail(state)
        else:
            # ---------------------------------------------------------- consumer warpgroups
            cute.arch.setmaxregister_increase(232)
            wg = cute.arch.make_warp_uniform(wg_idx - 1)  # 0 or 1: this warpgroup's rows and tail columns
            wtidx = tidx % self.threads_per_wg
            thr_main = main_mma.get_slice(wtidx)
            thr_tail = tail_mma.get_slice(wtidx)
            tCrA = main_mma.make_fragment_A(thr_main.partition_A(sA))  # indexed by box-stage
            tCrB = main_mma.make_fragment_B(thr_main.partition_B(sB))  # by stage
            tTrA = tail_mma.make_fragment_A(thr_tail.partition_A(sA))
            tTrB = tail_mma.make_fragment_B(thr_tail.partition_B(sB_slice))  # by slice-stage
            acc = cute.make_rmem_tensor(thr_main.partition_shape_C((BOX_ROWS, self.tile_n)), self.acc_dtype)
            acc_tail = cute.make_rmem_tensor(thr_tail.partition_shape_C((BOX_ROWS, self.slice_n)), self.acc_dtype)
            thr_out = out_mma.get_slice(wtidx)
            thr_out_tail = out_tail_mma.get_slice(wtidx)
            out = acc  # plain epilogue: in place
            out_tail = acc_tail
            if cutlass.const_expr(self.gated):
                # in place too (apply_epilogue walks the output groups upward over the accumulator's registers)
                out = cute.make_tensor(acc.iterator, cute.make_layout(
                    thr_out.partition_shape_C((BOX_ROWS, self.out_tile_n))))
                out_tail = cute.make_tensor(acc_tail.iterator, cute.make_layout(
                    thr_out_tail.partition_shape_C((BOX_ROWS, self.out_slice_n))))
            coords_acc = thr_main.partition_C(cute.make_identity_tensor((BOX_ROWS, self.tile_n)))
            coords_tail = thr_tail.partition_C(cute.make_identity_tensor((BOX_ROWS, self.slice_n)))
            coords_out = thr_out.partition_C(cute.make_identity_tensor((BOX_ROWS, self.out_tile_n)))
            coords_out_tail = thr_out_tail.partition_C(cute.make_identity_tensor((BOX_ROWS, self.out_slice_n)))
            num_k_blocks = cute.size(tCrA, mode=[2])

            # epilogue copies: registers -> SMEM (stmatrix), SMEM -> global (TMA); one set per output tile shape
            copy_atom_r2s = sm90_utils.get_smem_store_op(self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype)
            copy_atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.c_dtype)
            r2s_main = cute.make_tiled_copy_S(copy_atom_r2s, cute.make_tiled_copy_C_atom(copy_atom_c, out_mma))
            r2s_tail = cute.make_tiled_copy_S(copy_atom_r2s, cute.make_tiled_copy_C_atom(copy_atom_c, out_tail_mma))
            thr_r2s_main = r2s_main.get_slice(wtidx)
            thr_r2s_tail = r2s_tail.get_slice(wtidx)
            tRS_sD = thr_r2s_main.partition_D(sC)
            tRS_sD_tail = thr_r2s_tail.partition_D(sC)
            tRS_rOut = r2s_main.retile(out)
            tRS_rOut_tail = r2s_tail.retile(out_tail)
            rd_shape = cute.shape(thr_r2s_main.partition_S(sC))
            tRS_rD = cute.make_rmem_tensor(rd_shape[:3], self.acc_dtype)
            tRS_rD_out = cute.make_rmem_tensor(rd_shape[:3], self.c_dtype)
            rd_tail_shape = cute.shape(thr_r2s_tail.partition_S(sC))
            tRS_rD_tail = cute.make_rmem_tensor(rd_tail_shape[:3], self.acc_dtype)
            tRS_rD_out_tail = cute.make_rmem_tensor(rd_tail_shape[:3], self.c_dtype)
            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads_per_wg),
            )
            epi_barrier = pipeline.NamedBarrier(barrier_id=1 + wg, num_threads=self.threads_per_wg)
            first_buf = wg * self.epi_stages
            is_store_warp = warp_idx == 4 + 4 * wg

            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            sched_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sched_stages)
            epi_count = cutlass.Int32(0)
            unit = bidx
            if cutlass.const_expr(self.scheduler == SCHED_DYNAMIC):
                unit = self.read_published_unit(sched, sched_read, slots)
                sched_read.advance()
            total = self.total_units(s_rows)
            while unit < total:
                m_block, nb, expert, _, _, _ = self.decode_unit(unit, s_rows, s_counts, pair_threshold, rank)
                boxes, first_slice, tail_box = self.unit_boxes(m_block, expert, s_rows, s_counts)
                tail_slice = first_slice + wg  # this warpgroup's slice of the weight tile for the tail rows
                multiplies = wg < boxes  # warpgroup-uniform
                fused = boxes == FUSED_BOXES
                acc.fill(0.0)
                acc_tail.fill(0.0)
                main_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                tail_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.fence()
                if fused:
                    for k in cutlass.range(k_tiles, unroll=1):
                        mainloop.consumer_wait(read_state)
                        self.issue_fused_k_tile(main_mma, tail_mma, acc, acc_tail, tCrA, tCrB, tTrA, tTrB,
                                                read_state.index, wg, tail_slice, num_k_blocks, True)
                        cute.nvgpu.warpgroup.wait_group(1)
                        if k > 0:
                            mainloop.consumer_release(release_state)
                            release_state.advance()
                        read_state.advance()
                    cute.nvgpu.warpgroup.wait_group(0)
                    mainloop.consumer_release(release_state)
                    release_state.advance()
                elif multiplies:
                    for k in cutlass.range(k_tiles, unroll=1):
                        mainloop.consumer_wait(read_state)
                        self.issue_fused_k_tile(main_mma, tail_mma, acc, acc_tail, tCrA, tCrB, tTrA, tTrB,
                                                read_state.index, wg, tail_slice, num_k_blocks, False)
                        cute.nvgpu.warpgroup.wait_group(1)
                        if k > 0:
                            mainloop.consumer_release(release_state)
                            release_state.advance()
                        read_state.advance()
                    cute.nvgpu.warpgroup.wait_group(0)
                    mainloop.consumer_release(release_state)
                    release_state.advance()
                else:
                    # no valid rows in this warpgroup's box (or a fused tail's own unit: no stages at all): keep
                    # the stage phases in step, no MMAs
                    wait_tiles = k_tiles if boxes > 0 else 0
                    for k in cutlass.range(wait_tiles, unroll=1):
                        mainloop.consumer_wait(read_state)
                        mainloop.consumer_release(release_state)
                        release_state.advance()
                        read_state.advance()

                # ---- epilogue: each warpgroup stores its own rows (warpgroup-uniform branches)
                row0 = m_block * self.tile_m
                if multiplies:
                    self.apply_epilogue(acc, out, coords_acc, coords_out, expert, nb, row0 + wg * BOX_ROWS, bias,
                                        row_scale)
                    epi_count = self.store_tile(
                        gC[(None, None, m_block * 2 + wg, nb)], sC, tma_atom_c, r2s_main, tRS_rOut, tRS_rD, tRS_rD_out,
                        tRS_sD, store_pipe, epi_barrier, first_buf, epi_count, is_store_warp,
                    )
                if fused:  # the tail rows, this warpgroup's slice of the columns
                    self.apply_epilogue(acc_tail, out_tail, coords_tail, coords_out_tail, expert, nb,
                                        tail_box * BOX_ROWS, bias, row_scale, tail_slice * self.slice_n)
                    epi_count = self.store_tile(
                        gC_slice[(None, None, tail_box, nb * self.tail_slices + tail_slice)], sC, tma_atom_c, r2s_tail,
                        tRS_rOut_tail, tRS_rD_tail, tRS_rD_out_tail, tRS_sD_tail, store_pipe, epi_barrier, first_buf,
                        epi_count, is_store_warp,
                    )
                if cutlass.const_expr(self.scheduler == SCHED_DYNAMIC):
                    unit = self.read_published_unit(sched, sched_read, slots)
                    sched_read.advance()
                else:
                    unit = unit + num_clusters
            store_pipe.producer_tail()

    @cute.jit
    def issue_fused_k_tile(self, main_mma, tail_mma, acc, acc_tail, tCrA, tCrB, tTrA, tTrB, stage, wg, tail_slice,
                           num_k_blocks: cutlass.Constexpr, fused: cutlass.Constexpr):
        """One K tile (SMEM stage `stage`) as one committed wgmma group: this warpgroup's 64 rows x the weight tile,
        and with `fused` the tail's 64 rows x slice `tail_slice` of it. Fences first (see issue_k_tile)."""
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(num_k_blocks):
            cute.gemm(main_mma, acc, tCrA[(None, None, kb, stage * FUSED_BOXES + wg)], tCrB[(None, None, kb, stage)],
                      acc)
        if cutlass.const_expr(fused):
            for kb in cutlass.range_constexpr(num_k_blocks):
                cute.gemm(tail_mma, acc_tail, tTrA[(None, None, kb, stage * FUSED_BOXES + FUSED_BOXES - 1)],
                          tTrB[(None, None, kb, stage * self.tail_slices + tail_slice)], acc_tail)
        cute.nvgpu.warpgroup.commit_group()
