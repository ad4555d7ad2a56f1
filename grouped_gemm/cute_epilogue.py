"""Epilogue helpers of the sm90 regular grouped GEMM (cute_backend.py): the epilogue math in registers (bias,
gated activation, row scale) and the stores (registers -> SMEM by stmatrix -> C by TMA), as a mixin of
Sm90GroupedGemmKernel. Import lazily, like cute_backend.py (it imports `cutlass`).

The wgmma accumulator's register order per thread is (2 columns, 2 rows, tile_n / 8 column groups); GEMM1's
prepacked weights (W13Layout.CHUNKED) put 8 gate columns and then the 8 matching up columns, so gate group 2w
pairs with up group 2w + 1 of the same thread.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .epilogue import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

EPI_SWIGLU = "swiglu"
EPI_GELU_GATED = "gelu_gated"
EPI_SWIGLU_OAI = "swiglu_oai"
EPI_PLAIN = "plain"  # GEMM2: optional bias, optional row scale
GATED_EPILOGUES = (EPI_SWIGLU, EPI_GELU_GATED, EPI_SWIGLU_OAI)


class Sm90EpilogueMixin:
    """What the consumer warpgroups run after a unit's mainloop. The kernel class sets epi_tile, epi_stages,
    epi_barrier, c_dtype, gated, epilogue, out_tile_n, tile_m, tile_n, n, has_bias, has_row_scale,
    activation_under_next."""

    # ------------------------------------------------------------------ epilogue store
    @cute.jit
    def store_tile(self, gC_tile, sC, tma_atom_c, tiled_copy_r2s, tRS_rOut, tRS_rD, tRS_rD_out, tRS_sD, store_pipe,
                   epi_barrier, first_buf, epi_count, is_store_warp) -> cutlass.Int32:
        """One warpgroup's output tile (registers `tRS_rOut`, fp32) -> C: per epilogue sub-tile, convert,
        stmatrix into SMEM buffer first_buf + (count % epi_stages), one TMA store by the store warp.
        Returns the new sub-tile count (the caller carries it: the buffer rotation spans units)."""
        size_rD = cute.size(tRS_rD)
        for epi_idx in cutlass.range_constexpr(self.epi_count_per_tile(gC_tile)):
            for v in cutlass.range_constexpr(size_rD):
                tRS_rD[v] = tRS_rOut[epi_idx * size_rD + v]
            tRS_rD_out.store(tRS_rD.load().to(self.c_dtype))
            epi_count = self.store_subtile(epi_idx, gC_tile, sC, tma_atom_c, tiled_copy_r2s, tRS_rD_out, tRS_sD,
                                           store_pipe, epi_barrier, first_buf, epi_count, is_store_warp)
        return epi_count

    @cute.jit
    def store_held_subtile(self, held, epi_idx: cutlass.Constexpr, gC_tile, sC, tma_atom_c, tiled_copy_r2s,
                           tRS_rD_out, tRS_sD, store_pipe, epi_count, is_store_warp) -> cutlass.Int32:
        """Sub-tile epi_idx of a tile held in C's dtype (EpilogueStore.UNDER_NEXT_MAINLOOP; COOPERATIVE) -> C.
        ACTIVATION_UNDER_NEXT_MAINLOOP: `held` holds (gate, up) pairs as 32-bit words, and the sub-tile's
        activation is computed here (in fp32, from the 16-bit gate and up)."""
        size_rD = cute.size(tRS_rD_out)
        if cutlass.const_expr(self.activation_under_next):
            gate_up = cute.make_rmem_tensor(2 * size_rD, self.acc_dtype)
            if cutlass.const_expr(self.c_dtype == cutlass.BFloat16):
                # a bf16 value's bits are the upper half of its fp32 value's (the gate is the word's low half); this
                # integer unpack keeps ptxas from spilling, where a 16-bit conversion of each half did
                bits = cute.make_rmem_tensor(2 * size_rD, cutlass.Int32)
                for v in cutlass.range_constexpr(size_rD):
                    word = held[epi_idx * size_rD + v]
                    bits[2 * v] = word << 16
                    bits[2 * v + 1] = word & cutlass.Int32(-65536)
                gate_up = cute.recast_tensor(bits, self.acc_dtype)
            else:
                words = cute.make_rmem_tensor(size_rD, cutlass.Int32)
                for v in cutlass.range_constexpr(size_rD):
                    words[v] = held[epi_idx * size_rD + v]
                gate_up.store(cute.recast_tensor(words, self.c_dtype).load().to(self.acc_dtype))
            result = cute.make_rmem_tensor_like(tRS_rD_out, self.acc_dtype)
            for v in cutlass.range_constexpr(size_rD):
                result[v] = self.activation(gate_up[2 * v], gate_up[2 * v + 1])
            tRS_rD_out.store(result.load().to(self.c_dtype))
        else:
            for v in cutlass.range_constexpr(size_rD):
                tRS_rD_out[v] = held[epi_idx * size_rD + v]
        return self.store_subtile(epi_idx, gC_tile, sC, tma_atom_c, tiled_copy_r2s, tRS_rD_out, tRS_sD, store_pipe,
                                  self.epi_barrier, 0, epi_count, is_store_warp)

    @cute.jit
    def store_subtile(self, epi_idx: cutlass.Constexpr, gC_tile, sC, tma_atom_c, tiled_copy_r2s, tRS_rD_out, tRS_sD,
                      store_pipe, epi_barrier, first_buf, epi_count, is_store_warp) -> cutlass.Int32:
        """Registers `tRS_rD_out` (C's dtype) -> SMEM buffer first_buf + (epi_count % epi_stages) by stmatrix ->
        sub-tile epi_idx of gC_tile by one TMA store of the store warp, which then waits until an older store
        released its buffer; the warpgroups meet before and after. Returns epi_count + 1."""
        gC_epi = cute.zipped_divide(gC_tile, self.epi_tile)
        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
            tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi
        )
        epi_shape = gC_epi.shape[1]
        epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        buf = first_buf + epi_count % self.epi_stages
        cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, buf)])
        cute.arch.fence_proxy("async.shared", space="cta")
        epi_barrier.arrive_and_wait()
        if is_store_warp:
            cute.copy(tma_atom_c, bSG_sD[(None, buf)], bSG_gD[(None, epi_layout.get_hier_coord(epi_idx))])
            store_pipe.producer_commit()
            store_pipe.producer_acquire()
        epi_barrier.arrive_and_wait()
        return epi_count + 1

    def epi_count_per_tile(self, gC_tile) -> int:
        """Epilogue sub-tiles per output tile (static)."""
        return cute.size(cute.zipped_divide(gC_tile, self.epi_tile), mode=[1])


    # ------------------------------------------------------------------ epilogue math
    @cute.jit
    def apply_epilogue(self, acc, out, coords_acc, coords_out, expert, nb, r0, bias, row_scale,
                       col0=0):
        """acc (rows x columns of n-block nb from its column col0 on, fp32) -> out (rows x half the columns when
        gated, fp32) in registers; r0 = the row of C that out's first row is (coords_out count from it).
        `out` may be a view of acc's first registers (gated, fused_tail kernel): output group w overwrites
        accumulator group w, which only the outputs before it read."""
        self.add_bias(acc, coords_acc, expert, nb, bias, col0)
        if cutlass.const_expr(self.gated):
            # wgmma C layout per thread: (2 cols, 2 rows, columns/8 groups); the prepacked weight puts
            # 8 gate columns then the 8 matching up columns, so gate group 2w pairs with up group 2w+1
            groups_out = cute.size(out, mode=[0]) // 4
            for m in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                for w in cutlass.range_constexpr(groups_out):
                    for ab in cutlass.range_constexpr(4):
                        gate = acc[(ab + 8 * w, m, 0)]
                        up = acc[(ab + 8 * w + 4, m, 0)]
                        out[(ab + 4 * w, m, 0)] = self.activation(gate, up)
        if cutlass.const_expr(self.has_row_scale):
            for i in cutlass.range_constexpr(cute.size(out)):
                out[i] = out[i] * row_scale[r0 + coords_out[i][0]]

    @cute.jit
    def add_bias(self, acc, coords_acc, expert, nb, bias, col0=0):
        """acc += bias[expert, n-block nb's columns from col0 on] (fp32, in the accumulator's register order)."""
        if cutlass.const_expr(self.has_bias):
            n0 = nb * self.tile_n + col0
            if cutlass.const_expr(self.n % self.tile_n):
                # a partial last n-block: its missing columns (never stored) read the last bias column
                last = cutlass.min(cutlass.Int32(self.tile_n - 1), self.n - 1 - n0)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = acc[i] + bias[expert, n0 + cutlass.min(coords_acc[i][1], last)]
            else:
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = acc[i] + bias[expert, n0 + coords_acc[i][1]]

    @cute.jit
    def hold_gate_up(self, acc, out, tRS_rOut, up_out, up_view, held, coords_acc, expert, nb, bias):
        """ACTIVATION_UNDER_NEXT_MAINLOOP: acc (+ bias) -> held[i] = output i's gate and up in C's dtype (one 32-bit
        word, gate first), i in the register order of the output tile (tRS_rOut, a view of `out`; up_view one of
        up_out)."""
        self.add_bias(acc, coords_acc, expert, nb, bias)
        self.take_half(acc, out, 0)  # gate group 2w of the prepacked columns
        self.take_half(acc, up_out, 4)  # up group 2w + 1
        pairs = cute.make_rmem_tensor(2 * cute.size(tRS_rOut), self.acc_dtype)
        for i in cutlass.range_constexpr(cute.size(tRS_rOut)):
            pairs[2 * i] = tRS_rOut[i]
            pairs[2 * i + 1] = up_view[i]
        cute.recast_tensor(held, self.c_dtype).store(pairs.load().to(self.c_dtype))

    @cute.jit
    def take_half(self, acc, out, half: cutlass.Constexpr):
        """out (tile_m x out_tile_n) <- the gate (half 0) or up (half 4) columns of acc (see apply_epilogue)."""
        for m in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            for w in cutlass.range_constexpr(self.out_tile_n // 8):
                for ab in cutlass.range_constexpr(4):
                    out[(ab + 4 * w, m, 0)] = acc[(ab + 8 * w + half, m, 0)]

    @cute.jit
    def activation(self, gate: cutlass.Float32, up: cutlass.Float32) -> cutlass.Float32:
        """The gated activation of one output. The sigmoids take an approximate reciprocal (rcp.approx, about 1 ulp
        of fp32; the output is rounded to 16 bits): an IEEE division (div.rn.f32, a multi-instruction sequence
        with a slow path) per output made the epilogue math a third of GEMM1's time at qwen3-30b-a3b T=8192
        (docs/perf-notes-sm90.md v13)."""
        result = gate
        if cutlass.const_expr(self.epilogue == EPI_SWIGLU):
            result = gate * cute.arch.rcp_approx(1.0 + cute.math.exp(-gate, fastmath=True)) * up
        elif cutlass.const_expr(self.epilogue == EPI_GELU_GATED):
            result = 0.5 * gate * (1.0 + cute.math.erf(gate * 0.7071067811865476)) * up
        else:
            g = cutlass.min(gate, cutlass.Float32(SWIGLU_OAI_LIMIT))
            u = cutlass.max(cutlass.min(up, cutlass.Float32(SWIGLU_OAI_LIMIT)), cutlass.Float32(-SWIGLU_OAI_LIMIT))
            result = (u + 1.0) * (g * cute.arch.rcp_approx(1.0 + cute.math.exp(-SWIGLU_OAI_ALPHA * g, fastmath=True)))
        return result
