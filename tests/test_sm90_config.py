"""CPU tier of the sm90 CuTe grouped GEMM's host side: weight prepacking, workspaces, the configuration layer
(grouped_gemm/sm90_config.py: can_implement's limits, stage counts, kernel keys), the layer's policies
(sm90_grouped_gemm.py: default configurations by rows per expert, expert classes) and the kernel cache. No GPU and
no CuTe DSL needed; tests/test_sm90_compile.py compiles the kernels."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from moe2cta.grouped_gemm import Activation, GemmStage
from moe2cta.grouped_gemm import cute_runtime as rt
from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
from moe2cta.grouped_gemm.budget import WorkUnit
from moe2cta.presets import PRESETS

G1, G2 = GemmStage.GEMM1, GemmStage.GEMM2

def test_prepack_interleaves_gate_and_up_in_chunks_of_8():
    e, inter, h = 2, 32, 5
    w13 = torch.randn(e, 2 * inter, h)
    packed = s90.prepack_w13(w13)
    assert packed.shape == w13.shape
    for c in range(inter // 8):
        for j in range(8):
            assert torch.equal(packed[:, 16 * c + j], w13[:, 8 * c + j])  # gate
            assert torch.equal(packed[:, 16 * c + 8 + j], w13[:, inter + 8 * c + j])  # up


def test_each_launch_gets_its_own_zeroed_workspace():
    """DYNAMIC launches get a fresh zeroed workspace (no state shared between launches, streams or graph replays:
    tests/test_graph_pools.py is the GPU case); STATIC launches get an unused one."""
    dynamic = s90.Sm90GemmConfig(scheduler=s90.Scheduler.DYNAMIC)
    first, _, _ = s90._launch_scratch(dynamic, torch.device("cpu"))
    second, bias, scale = s90._launch_scratch(dynamic, torch.device("cpu"))
    assert torch.equal(first, torch.zeros(4, dtype=torch.int32)) and first.data_ptr() != second.data_ptr()
    assert bias.shape == (1, 1) and bias.dtype == scale.dtype == torch.float32
    static, _, _ = s90._launch_scratch(s90.Sm90GemmConfig(scheduler=s90.Scheduler.STATIC), torch.device("cpu"))
    assert static.shape == (4,) and static.dtype == torch.int32


def test_dynamic_sides_workspace_limits_and_key():
    """DYNAMIC_SIDES: a fresh workspace per launch with zeroed counters and the device's side map after them (zeros,
    the DYNAMIC order, until one is set; a set map is validated and reinstalled without a copy); the regular kernel
    only; its own kernel key."""
    from moe2cta.grouped_gemm import l2_sides

    l2_sides.clear_side_maps()
    sides = s90.Sm90GemmConfig(scheduler=s90.Scheduler.DYNAMIC_SIDES, tile_n=128)
    cpu = torch.device("cpu")
    first, _, _ = s90._launch_scratch(sides, cpu)
    assert first.shape == (4 + l2_sides.SIDE_MAP_ENTRIES,) and not first.any()
    installed = l2_sides.set_side_map(cpu, [1, 0, 1])
    second, _, _ = s90._launch_scratch(sides, cpu)
    assert second[:4].tolist() == [0, 0, 0, 0] and second[4:8].tolist() == [1, 0, 1, 0] and int(second.sum()) == 2
    assert second.data_ptr() != first.data_ptr()
    assert l2_sides.set_side_map(cpu, installed) is installed and l2_sides.side_map(cpu) is installed
    with pytest.raises(ValueError, match="sides: expected 0 or 1"):
        l2_sides.set_side_map(cpu, [0, 2])
    with pytest.raises(ValueError, match="sides: at most 256"):
        l2_sides.set_side_map(cpu, [0] * 257)
    l2_sides.clear_side_maps()
    p1 = s90.Sm90Problem(G1, 512, 256, 8, torch.bfloat16, Activation.SWIGLU)
    assert s90.can_implement(sides, p1) == (True, "")
    for other in (dataclasses.replace(sides, operands=s90.Operands.WEIGHTS_AS_M, tile_m=32),
                  dataclasses.replace(sides, raster=s90.Raster.EXPERT_GROUPED_M, padding_rows=s90.PaddingRows.FUSE_TAIL)):
        ok, why = s90.can_implement(other, p1)
        assert not ok and "DYNAMIC_SIDES" in why, why
    dynamic = dataclasses.replace(sides, scheduler=s90.Scheduler.DYNAMIC)
    assert s90.kernel_key(sides, p1) != s90.kernel_key(dynamic, p1)
    assert s90.kernel_from_key(s90.kernel_key(sides, p1))[0].scheduler is s90.Scheduler.DYNAMIC_SIDES


def test_prepack_rejects_bad_shapes():
    with pytest.raises(TypeError, match="w13"):
        s90.prepack_w13(torch.randn(4, 8))
    with pytest.raises(ValueError, match="2I"):
        s90.prepack_w13(torch.randn(1, 24, 8))


def test_kernel_bias_is_the_per_call_conversion_made_once():
    """kernel_bias gives the epilogue operand epilogue_operands makes from the public bias (GEMM1: fp32, interleaved
    like the packed w13), and epilogue_operands passes it through unchanged; a bias of the other GEMM or of another
    shape is refused by name."""
    e, two_i, h = 3, 32, 24
    b13 = torch.randn(e, two_i, dtype=torch.bfloat16)
    b2 = torch.randn(e, h)
    want13, _ = s90.epilogue_operands(G1, e, two_i, 5, b13, None)
    kb13 = s90.kernel_bias(G1, b13)
    assert kb13.values.dtype == torch.float32 and kb13.values.is_contiguous()
    assert torch.equal(kb13.values, want13)
    assert torch.equal(kb13.values, s90.prepack_w13(b13.float().unsqueeze(-1)).squeeze(-1))
    got13, _ = s90.epilogue_operands(G1, e, two_i, 5, kb13, None)
    assert got13 is kb13.values  # nothing converted per call
    got2, _ = s90.epilogue_operands(G2, e, h, 5, s90.kernel_bias(G2, b2), None)
    assert torch.equal(got2, b2)
    with pytest.raises(ValueError, match="b2: a KernelBias made for GEMM1"):
        s90.epilogue_operands(G2, e, two_i, 5, kb13, None)
    with pytest.raises(TypeError, match=r"b13: expected \[3, 64\]"):
        s90.epilogue_operands(G1, e, 64, 5, kb13, None)
    with pytest.raises(TypeError, match="b13: expected a 2-d floating-point tensor"):
        s90.kernel_bias(G1, torch.zeros(e, two_i, dtype=torch.int32))


def test_can_implement_reasons():
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    assert s90.can_implement(s90.Sm90GemmConfig(), p1) == (True, "")
    assert s90.can_implement(s90.Sm90GemmConfig(work_unit=WorkUnit.PAIR), p1) == (True, "")
    # a partial last n-block: the regular kernel takes N = 2880 on 256-wide tiles, not N off the grid of whole gate /
    # up chunk pairs (GEMM1: 16 rows) or of 16-byte C rows (GEMM2: 8)
    assert s90.can_implement(s90.Sm90GemmConfig(tile_n=256), s90.Sm90Problem(G2, 2880, 2880, 128)) == (True, "")
    ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_n=256), s90.Sm90Problem(G2, 2884, 2880, 128))
    assert not ok and "tile_n" in why and "multiple of 8" in why
    ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_n=256),
                                s90.Sm90Problem(G1, 2888, 2880, 128, torch.bfloat16, Activation.SWIGLU))
    assert not ok and "tile_n" in why and "multiple of 16" in why
    # the policy takes a divisor of N where one exists (a partial n-block measured slower), else the tile with the
    # fewest missing columns
    assert s90.regular_config(s90.Sm90Problem(G2, 2880, 2880, 128), rows_per_expert=512.0).tile_n == 192
    assert s90.regular_config(s90.Sm90Problem(G1, 2000, 2048, 64, torch.bfloat16, Activation.SWIGLU)).tile_n == 256
    assert s90.regular_config(s90.Sm90Problem(G2, 2888, 1024, 64, torch.bfloat16, None, False, True)).tile_n == 128
    assert s90.default_config(s90.Sm90Problem(G2, 1000, 1000, 64, torch.bfloat16, None, False, True),
                              rows_per_expert=1.0).tile_n == 256
    with pytest.raises(ValueError, match="problem"):
        s90.regular_config(s90.Sm90Problem(G2, 1004, 512, 64, torch.bfloat16, None, False, True))
    ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_m=96), p1)
    assert not ok and "tile_m" in why
    assert s90.can_implement(s90.Sm90GemmConfig(work_unit=WorkUnit.PAIR, scheduler=s90.Scheduler.DYNAMIC), p1) == (
        True, "")
    ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_n=128, work_unit=WorkUnit.PAIR, scheduler=s90.Scheduler.DYNAMIC,
                                                   consumers=s90.Consumers.PINGPONG), p1)
    assert not ok and "DYNAMIC" in why and "COOPERATIVE" in why
    ok, why = s90.can_implement(s90.Sm90GemmConfig(), s90.Sm90Problem(G1, 1536, 2048, 8, torch.float32, Activation.SWIGLU))
    assert not ok and "dtype" in why


def test_epilogue_store_limits_key_and_policy():
    """UNDER_NEXT_MAINLOOP (a tile's stores under the next unit's mainloop) and ACTIVATION_UNDER_NEXT_MAINLOOP (GEMM1's
    activation math too) exist for COOPERATIVE regular kernels only, the second for GEMM1 only; both are part of the
    kernel's key, and the policy picks UNDER_NEXT_MAINLOOP wherever it exists (ACTIVATION_UNDER_NEXT_MAINLOOP is
    opt-in: measured, not a default)."""
    under = s90.EpilogueStore.UNDER_NEXT_MAINLOOP
    act = s90.EpilogueStore.ACTIVATION_UNDER_NEXT_MAINLOOP
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    p2 = s90.Sm90Problem(G2, 2048, 768, 128, torch.bfloat16, None, False, True)
    for store in (under, act):
        assert s90.can_implement(s90.Sm90GemmConfig(epilogue_store=store, work_unit=WorkUnit.PAIR), p1) == (True, "")
        ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_n=128, consumers=s90.Consumers.PINGPONG,
                                                       epilogue_store=store), p1)
        assert not ok and "epilogue_store" in why and "COOPERATIVE" in why
        ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_m=16, tile_n=128, tile_k=128,
                                                       operands=s90.Operands.WEIGHTS_AS_M, epilogue_store=store), p2)
        assert not ok and "epilogue_store" in why
    ok, why = s90.can_implement(s90.Sm90GemmConfig(epilogue_store=act), p2)
    assert not ok and "epilogue_store" in why and "GEMM1" in why
    ok, why = s90.can_implement(s90.Sm90GemmConfig(epilogue_store="under"), p1)
    assert not ok and "EpilogueStore" in why
    after = s90.Sm90GemmConfig()
    stems = {s90.kernel_key(dataclasses.replace(after, epilogue_store=store), p1).file_stem()
             for store in (s90.EpilogueStore.AFTER_MAINLOOP, under, act)}
    assert len(stems) == 3
    for problem in (p1, p2):
        for rows in (None, 64.0, 512.0, 4096.0):
            cfg = s90.default_config(problem, rows_per_expert=rows)
            if cfg.operands is s90.Operands.TOKENS_AS_M:
                assert cfg.epilogue_store is under, (problem.kind, rows)
        assert s90.default_config(problem, rows_per_expert=8.0).epilogue_store is s90.EpilogueStore.AFTER_MAINLOOP
    assert s90.token_rows_config(p1, 512.0).epilogue_store is under
    assert s90.default_epilogue_store(s90.Consumers.PINGPONG) is s90.EpilogueStore.AFTER_MAINLOOP


def test_dependent_launch_limits_and_key():
    """Every kernel takes PROGRAMMATIC (a programmatic dependent launch); the weight prefetch before the wait is the
    regular and the swapped kernels'. The choice is part of the key (a plain launch keeps the key it always had) and
    kernel_from_key reads it back."""
    DL = s90.DependentLaunch
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    p2 = s90.Sm90Problem(G2, 2048, 768, 128, torch.bfloat16, None, False, True)
    configs = [s90.default_config(p1, rows_per_expert=rows) for rows in (0.5, 128.0, 200.0, 512.0)]
    configs += [s90.Sm90GemmConfig(work_unit=WorkUnit.PAIR), s90.Sm90GemmConfig(tile_n=128, padding_rows=s90.PaddingRows.FUSE_TAIL)]
    for cfg in configs:
        for launch in DL:
            ok, why = s90.can_implement(dataclasses.replace(cfg, dependent_launch=launch), p1)
            fused = cfg.padding_rows is s90.PaddingRows.FUSE_TAIL
            assert ok == (not fused or launch is not DL.PROGRAMMATIC_WEIGHT_PREFETCH), (cfg, launch, why)
            if not ok:
                assert "dependent_launch" in why and "FUSE_TAIL" in why
    ok, why = s90.can_implement(s90.Sm90GemmConfig(dependent_launch="programmatic"), p1)
    assert not ok and "DependentLaunch" in why
    base = s90.default_config(p2, rows_per_expert=1024.0)
    keys = {launch: s90.kernel_key(dataclasses.replace(base, dependent_launch=launch), p2) for launch in DL}
    assert len({key.file_stem() for key in keys.values()}) == 3
    assert keys[DL.STREAM_ORDER] == s90.kernel_key(base, p2)
    assert not any(item[0] == "launch" for item in keys[DL.STREAM_ORDER].extra)
    for launch, key in keys.items():
        assert s90.kernel_from_key(key)[0].dependent_launch is launch


def test_policies_are_memoized_and_still_validate():
    """The per-forward host calls are cached (a layer makes them for every GEMM of every forward); arguments that
    cannot be hashed still get the functions' own answers."""
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    assert s90.default_config(p1, rows_per_expert=512.0) is s90.default_config(p1, rows_per_expert=512.0)
    assert s90.token_rows_config(p1, 512.0) is s90.token_rows_config(p1, 512.0)
    cfg = s90.default_config(p1, rows_per_expert=512.0)
    assert s90.kernel_key(cfg, p1) is s90.kernel_key(cfg, p1)
    assert s90.can_implement({"tile_m": 128}, p1) == (False, "config: expected Sm90GemmConfig, got dict")
    with pytest.raises(TypeError, match="rows_per_expert"):
        s90.default_config(p1, rows_per_expert=[512])


def test_stage_count_fits_the_smem_budget():
    for tile_m, tile_n in ((128, 256), (128, 192), (128, 128), (64, 256), (64, 64)):
        cfg = s90.Sm90GemmConfig(tile_m=tile_m, tile_n=tile_n)
        stages = s90.resolve_stages(cfg)
        assert 2 <= stages <= 8
        assert s90.smem_bytes(cfg, stages) <= 227 * 1024


def test_pingpong_epilogue_buffers_are_counted_per_warpgroup():
    """PINGPONG gives each of its two consumer warpgroups its own 64-row epilogue buffers: at tile_m 64 that is twice
    what the tile's rows alone would say (a 64x96x32 tile at 21 stages compiles to 234,496 B, over the 227 KiB a CTA
    may use, and was accepted at 229,384 B by the model before stop 55)."""
    problem = s90.Sm90Problem(G2, 4096, 4096, 256, torch.bfloat16, None, False, True)
    pingpong = s90.Sm90GemmConfig(tile_m=64, tile_n=96, tile_k=32, stages=21, consumers=s90.Consumers.PINGPONG,
                                  scheduler=s90.Scheduler.STATIC)
    cooperative = dataclasses.replace(pingpong, consumers=s90.Consumers.COOPERATIVE)
    assert s90.smem_bytes(pingpong, 21) - s90.smem_bytes(cooperative, 21) == 64 * 32 * 2 * 2
    ok, why = s90.can_implement(pingpong, problem)
    assert not ok and "SMEM" in why, why
    wide = dataclasses.replace(pingpong, tile_m=128, tile_n=128, stages=4)  # 128 rows: the same buffers either way
    assert s90.smem_bytes(wide, 4) == s90.smem_bytes(dataclasses.replace(wide, consumers=s90.Consumers.COOPERATIVE), 4)


def test_an_explicit_dynamic_sides_scheduler_at_decode_sizes_gets_the_regular_kernel():
    problem = s90.Sm90Problem(G2, 4096, 1536, 128, torch.bfloat16, None, False, True)
    config = s90.default_config(problem, s90.Scheduler.DYNAMIC_SIDES, rows_per_expert=8)
    assert config.operands is s90.Operands.TOKENS_AS_M and config.scheduler is s90.Scheduler.DYNAMIC_SIDES
    assert s90.can_implement(config, problem) == (True, "")


def test_every_preset_has_configs():
    for preset in PRESETS.values():
        configs = s90.preset_configs(preset)
        swapped = [cfg for cfg, _ in configs if cfg.operands is s90.Operands.WEIGHTS_AS_M and not cfg.wide]
        wide = [(cfg, p) for cfg, p in configs if cfg.wide]
        assert {p.kind for _, p in wide} == {G1, G2}
        regular = {(p.kind, c.scheduler, c.raster, c.work_unit) for c, p in configs if c.operands is s90.Operands.TOKENS_AS_M}
        S, D, N, GM = s90.Scheduler.STATIC, s90.Scheduler.DYNAMIC, s90.Raster.ALONG_N, s90.Raster.GROUPED_M
        EG = s90.Raster.EXPERT_GROUPED_M
        # per GEMM: the defaults (GEMM1: up to and above GEMM1_EXPERT_GROUPED_MAX_ROWS rows per expert; GEMM2: <= 128
        # and > 128), STATIC and PAIR alternatives
        alternatives = ((S, N, WorkUnit.SINGLE), (S, N, WorkUnit.PAIR))
        assert regular == ({(G1, *v) for v in ((D, EG, WorkUnit.SINGLE), (D, GM, WorkUnit.SINGLE)) + alternatives}
                           | {(G2, *v) for v in ((D, N, WorkUnit.SINGLE), (D, GM, WorkUnit.SINGLE)) + alternatives})
        for cfg, problem in configs:  # GEMM1's expert-grouped default skips its all-padding warpgroups
            if cfg.operands is s90.Operands.TOKENS_AS_M and cfg.tile_m == 128 and (
                    problem.kind is G2 or cfg.raster is EG):
                assert cfg.padding_rows is s90.PaddingRows.SKIP, (cfg, problem)
        for kind in (G1, G2):  # the decode kernels of both GEMMs, every token tile
            assert {cfg.tile_m for cfg, p in configs if p.kind is kind and cfg in swapped} == {16, 32, 64}
        for cfg, problem in configs:
            assert s90.can_implement(cfg, problem) == (True, "")


def test_swapped_weight_tile_narrows_when_few_experts_are_hit():
    """mixtral-8x7b T=1 GEMM2: 2 experts x 32 n-blocks of 128 would fill 64 of 132 SMs -> 64-row weight tiles."""
    p2 = s90.Sm90Problem(G2, 4096, 14336, 8, torch.bfloat16, None, False, True)
    assert s90.swapped_config(p2, rows_per_expert=2 / 8).tile_n == 64
    assert s90.swapped_config(p2, rows_per_expert=16 / 8).tile_n == 128  # 8 experts x 32 n-blocks
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    assert s90.swapped_config(p1, rows_per_expert=8 / 128).tile_n == 128  # qwen3-30b T=1: 8 x 12 units


def test_rows_per_expert_is_checked():
    p2 = s90.Sm90Problem(G2, 2048, 768, 128, torch.bfloat16, None, False, True)
    for bad in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match="rows_per_expert"):
            s90.default_config(p2, rows_per_expert=bad)
    with pytest.raises(TypeError, match="rows_per_expert"):
        s90.swapped_config(p2, "8")


def test_swapped_operands_limits():
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    W = s90.Operands.WEIGHTS_AS_M
    assert s90.can_implement(s90.Sm90GemmConfig(tile_m=16, tile_n=128, operands=W), p1) == (True, "")
    ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_m=96, tile_n=128, operands=W), p1)
    assert not ok and "tile_m" in why
    ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_m=16, tile_n=96, operands=W), p1)
    assert not ok and "tile_n" in why
    ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_m=16, tile_n=128, operands=W, work_unit=WorkUnit.PAIR), p1)
    assert not ok and "SINGLE" in why
    ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_m=16, tile_n=128), p1)  # 16 rows need swapped operands
    assert not ok and "tile_m" in why


def test_wide_swapped_limits_and_key():
    """Wide WEIGHTS_AS_M tiles: 128/256 token rows, 64/128 weight rows, a token_step of 8k dividing tile_m;
    decode tiles and TOKENS_AS_M take no token_step; the step is part of the key of wide kernels only."""
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    W = s90.Operands.WEIGHTS_AS_M
    wide = s90.Sm90GemmConfig(tile_m=256, tile_n=128, tile_k=64, operands=W, token_step=32)
    assert wide.wide and s90.can_implement(wide, p1) == (True, "")
    assert s90.can_implement(dataclasses.replace(wide, tile_m=128, token_step=0), p1) == (True, "")
    assert s90.can_implement(dataclasses.replace(wide, tile_m=128, tile_n=256), p1) == (True, "")  # 2 atoms per warpgroup
    # 160-row token tiles (an expert of 128 +- 32 rows in one unit): 32-row TMA boxes, up to 256 weight rows (160
    # accumulator registers per thread), 4 stages of 53 KB beside a staging tile of 16 x 256 or 32 x 128 outputs
    w160 = dataclasses.replace(wide, tile_m=160, tile_n=256)
    assert s90.can_implement(w160, p1) == (True, "") and s90.resolve_stages(w160) == 4
    assert s90.can_implement(dataclasses.replace(w160, tile_n=128), p1) == (True, "")
    assert s90.wide_token_box(160) == 32 and s90.wide_token_box(128) == s90.wide_token_box(256) == 64
    assert [s90.wide_epilogue_rows(160, 256, gated) for gated in (True, False)] == [32, 16]
    assert [s90.wide_epilogue_rows(160, 128, gated) for gated in (True, False)] == [32, 32]
    assert [s90.wide_epilogue_rows(m, n, True) for m, n in ((128, 256), (256, 128), (128, 128))] == [32, 64, 64]
    assert s90.smem_bytes(w160, 4) <= s90.ARCH_LIMITS[s90.Arch.SM90].smem_per_cta
    # 288-row token tiles (an expert of 256 +- 32 rows in one unit): 32-row boxes, at most 128 weight rows (144
    # accumulator registers), a token_step of 16k (each half of a unit above 144 rows is a wgmma N)
    w288 = dataclasses.replace(wide, tile_m=288)
    assert s90.can_implement(w288, p1) == (True, "") and s90.resolve_stages(w288) == 4
    assert s90.can_implement(dataclasses.replace(w288, token_step=16), p1) == (True, "")
    assert s90.wide_token_box(288) == 32 and s90.wide_epilogue_rows(288, 128, False) == 32
    for bad, word in ((dataclasses.replace(w288, tile_n=256), "tile_m"), (dataclasses.replace(w288, token_step=24), "token_step"),
                      (dataclasses.replace(w288, token_step=8), "token_step")):
        ok, why = s90.can_implement(bad, p1)
        assert not ok and why.startswith(word), (bad, why)
    # a partial last n-block: the wide kernel takes one (gpt-oss GEMM2, N = 2880 on 128 weight rows), the decode one
    # does not; wide_config picks a whole n-block unless given tile_n
    p2_oss = s90.Sm90Problem(G2, 2880, 2880, 128, torch.bfloat16, None, True, True)
    assert s90.can_implement(dataclasses.replace(w288, tile_n=128), p2_oss) == (True, "")
    assert s90.wide_config(p2_oss, tile_m=288, tile_n=128).tile_n == 128
    ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_m=16, tile_n=128, operands=W), p2_oss)
    assert not ok and "whole n-blocks" in why
    p1_odd = s90.Sm90Problem(G1, 5768, 2880, 128, torch.bfloat16, Activation.SWIGLU)  # 2I not a multiple of 16
    ok, why = s90.can_implement(w288, p1_odd)
    assert not ok and why.startswith("n"), why
    for bad, word in ((dataclasses.replace(wide, tile_n=192), "tile_n"), (dataclasses.replace(wide, tile_n=256), "tile_m"),
                      (dataclasses.replace(wide, token_step=24), "token_step"),
                      (dataclasses.replace(w160, token_step=64), "token_step"),  # 64 does not divide 160
                      (dataclasses.replace(wide, tile_m=192, token_step=0), "tile_m"),
                      (dataclasses.replace(wide, token_step=12), "token_step"), (dataclasses.replace(wide, token_step=-8), "token_step"),
                      (s90.Sm90GemmConfig(tile_m=16, tile_n=128, operands=W, token_step=8), "token_step"),
                      (s90.Sm90GemmConfig(token_step=32), "token_step")):
        ok, why = s90.can_implement(bad, p1)
        assert not ok and why.startswith(word), (bad, why)
    stems = {s90.kernel_key(dataclasses.replace(wide, token_step=t), p1).file_stem() for t in (16, 32)}
    assert len(stems) == 2 and all("token-step" in stem or "token_step" in stem for stem in stems)
    assert "token" not in s90.kernel_key(s90.swapped_config(p1, 1), p1).file_stem()
    # N = 2880 (gpt-oss GEMM2) is no multiple of 128: the wide tile takes 64 weight rows (one warpgroup)
    p2 = s90.Sm90Problem(G2, 2880, 2880, 128, torch.bfloat16, None, True, True)
    assert s90.wide_config(p2).tile_n == 64 and s90.wide_config(p1).tile_n == 128
    assert s90.wide_config(s90.Sm90Problem(G2, 2888, 2880, 128, torch.bfloat16, None, True, True)) is None


def test_which_kernels_take_expert_subsets():
    """Expert classes give each launch a subset of the experts through the counts: the swapped-operand kernels count
    their tiles from the counts, the regular kernel skips a unit without valid rows where each unit has one CTA and
    COOPERATIVE consumers; PAIR, PINGPONG and the fused-tail kernels do not."""
    Cfg = s90.Sm90GemmConfig
    assert Cfg().takes_expert_subsets and Cfg(padding_rows=s90.PaddingRows.SKIP).takes_expert_subsets
    assert Cfg(operands=s90.Operands.WEIGHTS_AS_M, tile_m=16, tile_n=128).takes_expert_subsets
    assert Cfg(operands=s90.Operands.WEIGHTS_AS_M, tile_m=288, tile_n=128, token_step=32).takes_expert_subsets
    assert not Cfg(work_unit=WorkUnit.PAIR).takes_expert_subsets
    assert not Cfg(tile_n=128, consumers=s90.Consumers.PINGPONG).takes_expert_subsets
    assert not Cfg(padding_rows=s90.PaddingRows.FUSE_TAIL).takes_expert_subsets
    assert not Cfg(padding_rows=s90.PaddingRows.SPLIT_TAIL).takes_expert_subsets


def test_expert_classes_policy_and_class_counts():
    """Three classes (160-row tile, 288-row tile, regular kernel) where the 288-row tile's rows per expert fall on more
    than WIDE288_MAX_EXPERTS experts (GEMM2 at K >= 2048); one launch elsewhere. class_counts gives every expert to
    exactly one class, by its rows, and its rows start 16-byte aligned."""
    bf = torch.bfloat16
    g1 = s90.Sm90Problem(GemmStage.GEMM1, 4096, 7168, 256, bf, Activation.SWIGLU, False)  # deepseek-v3
    g2 = s90.Sm90Problem(G2, 7168, 2048, 256, bf, None, False, True)
    for problem in (g1, g2):
        classes = s90.expert_classes(problem, 256)
        assert [c.max_rows for c in classes] == [160, 288, None]
        assert [(c.config.operands, c.config.tile_m, c.config.expert_split) for c in classes[:2]] == [
            (s90.Operands.WEIGHTS_AS_M, 160, s90.ExpertSplit.EVEN), (s90.Operands.WEIGHTS_AS_M, 288, s90.ExpertSplit.EVEN)]
        assert classes[2].config == s90.default_config(problem, rows_per_expert=256)
        assert all(s90.can_implement(c.config, problem)[0] and c.config.takes_expert_subsets for c in classes)
        assert all(c.config in [cfg for cfg, p in s90.preset_configs(PRESETS["deepseek-v3"]) if p == problem]
                   for c in classes)
        for rows in (None, 100, 144, 257, 512):  # outside (144, 256]: one launch
            assert s90.expert_classes(problem, rows) == ()
    assert len(s90.expert_classes(g1, 145)) == 3
    assert s90.expert_classes(dataclasses.replace(g1, num_experts=128), 256) == ()  # the 288-row tile's own range
    assert s90.expert_classes(dataclasses.replace(g2, k=1536), 256) == ()  # GEMM2 at short K
    with pytest.raises(TypeError, match="problem"):
        s90.expert_classes("deepseek", 256)
    counts = torch.tensor([0, 1, 160, 161, 288, 289, 600], dtype=torch.int32)
    per_class = s90.class_counts(counts, s90.class_bounds("cpu"))
    assert per_class.dtype == torch.int32 and per_class.shape == (3, 7)
    assert per_class.tolist() == [[0, 1, 160, 0, 0, 0, 0], [0, 0, 0, 161, 288, 0, 0], [0, 0, 0, 0, 0, 289, 600]]
    assert all(row.is_contiguous() and (row.data_ptr() - per_class.data_ptr()) % 16 == 0 for row in per_class)
    with pytest.raises(TypeError, match="counts"):
        s90.class_counts(counts.long(), s90.class_bounds("cpu"))
    with pytest.raises(TypeError, match="bounds"):
        s90.class_counts(counts, s90.class_bounds("cpu").long())


def test_default_config_by_rows_per_expert():
    p2 = s90.Sm90Problem(G2, 2048, 768, 128, torch.bfloat16, None, False, True)
    assert s90.default_config(p2).operands is s90.Operands.TOKENS_AS_M
    few = s90.default_config(p2, rows_per_expert=0.06)
    assert (few.operands, few.tile_m) == (s90.Operands.WEIGHTS_AS_M, 16)
    assert s90.default_config(p2, rows_per_expert=8).tile_m == 16
    assert s90.default_config(p2, rows_per_expert=16).tile_m == 32
    assert s90.swapped_config(p2, rows_per_expert=s90.SWAPPED_MAX_ROWS_PER_EXPERT).tile_m == 64
    assert few.raster is s90.Raster.ALONG_N and few.tile_n == 128
    # regular kernel: DYNAMIC; ALONG_N while experts hold about one m-block, GROUPED_M above (or unknown)
    # the wide swapped kernel where it measured best: GEMM2 at 16-32 rows per expert (128-row token tiles), and
    # both GEMMs of layers with few experts at 32-192 rows (256-row token tiles); the regular kernel elsewhere
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    lo, hi = s90.WIDE_GEMM2_ROWS_PER_EXPERT
    for rows in (lo + 0.5, hi):
        mid = s90.default_config(p2, rows_per_expert=rows)
        assert (mid.wide, mid.tile_m, mid.scheduler) == (True, 128, s90.Scheduler.STATIC)
        assert s90.default_overrides_tuning(p2, rows) and s90.default_overrides_tuning(p1, rows)  # decode GEMM1
        assert not s90.default_config(p1, rows_per_expert=rows).wide
    assert s90.default_config(p2, rows_per_expert=lo).tile_m == 32  # the decode kernel below the range
    mixtral2 = s90.Sm90Problem(G2, 4096, 14336, 8, torch.bfloat16, None, False, True)
    mixtral1 = s90.Sm90Problem(G1, 28672, 4096, 8, torch.bfloat16, Activation.SWIGLU)
    lo, hi = s90.WIDE_ROWS_PER_EXPERT
    lo160, hi160 = s90.WIDE160_ROWS_PER_EXPERT
    for rows in (lo + 1, lo160):
        for problem in (mixtral2, mixtral1):
            mid = s90.default_config(problem, rows_per_expert=rows)
            assert (mid.wide, mid.tile_m, mid.scheduler) == (True, 256, s90.Scheduler.STATIC), (problem, rows)
        assert not s90.default_config(p2, rows_per_expert=rows).wide  # 128 experts: the regular kernel
    # about 256 rows per expert: 288-row token tiles on 128 weight rows, on at most 128 experts, GEMM2 at long K only
    # (gpt-oss GEMM2: N = 2880 in a partial last n-block)
    lo288, hi288 = s90.WIDE288_ROWS_PER_EXPERT
    assert lo288 == hi160 and hi >= lo288
    gpt_oss = [s90.Sm90Problem(G1, 5760, 2880, 128, torch.bfloat16, Activation.SWIGLU_OAI, True),
               s90.Sm90Problem(G2, 2880, 2880, 128, torch.bfloat16, None, True, True)]
    deepseek = [s90.Sm90Problem(G1, 4096, 7168, 256, torch.bfloat16, Activation.SWIGLU),
                s90.Sm90Problem(G2, 7168, 2048, 256, torch.bfloat16, None, False, True)]
    for rows in (lo288 + 0.5, hi, 256, hi288):
        for problem in (mixtral1, mixtral2, p1, *gpt_oss):
            mid = s90.default_config(problem, rows_per_expert=rows)
            assert (mid.wide, mid.tile_m, mid.tile_n, mid.token_step, mid.scheduler, mid.expert_split) == (
                True, 288, 128, 32, s90.Scheduler.STATIC, s90.ExpertSplit.EVEN), (problem, rows)
        for problem in (p2, *deepseek):  # K 768 < WIDE288_GEMM2_MIN_K; 256 experts
            assert not s90.default_config(problem, rows_per_expert=rows).wide, (problem, rows)
    for problem in (mixtral1, p1, *gpt_oss):
        assert not s90.default_config(problem, rows_per_expert=hi288 + 1).wide
    # GEMM2 at K >= WIDE288_LONG_K_GEMM2_MIN_K (mixtral-8x7b: 14336) keeps the 288-row tile up to two tiles per expert
    long_k = s90.WIDE288_LONG_K_MAX_ROWS
    assert mixtral2.k >= s90.WIDE288_LONG_K_GEMM2_MIN_K > max(p.k for p in (p2, *gpt_oss, *deepseek))
    for rows in (hi288 + 1, 512, long_k):
        mid = s90.default_config(mixtral2, rows_per_expert=rows)
        assert (mid.wide, mid.tile_m, mid.expert_split) == (True, 288, s90.ExpertSplit.EVEN), rows
        assert s90.default_overrides_tuning(mixtral2, rows)
        for problem in (mixtral1, gpt_oss[1], deepseek[1]):
            assert not s90.default_config(problem, rows_per_expert=rows).wide, (problem, rows)
    assert not s90.default_config(mixtral2, rows_per_expert=long_k + 1).wide
    # about 128 rows per expert: 160-row token tiles on 256 weight rows, any expert count where N allows 256
    p1_235 = s90.Sm90Problem(G1, 3072, 4096, 128, torch.bfloat16, Activation.SWIGLU)
    for rows in (lo160 + 0.5, 128, hi160):
        for problem in (mixtral1, mixtral2, p1, p2, p1_235):
            mid = s90.default_config(problem, rows_per_expert=rows)
            assert (mid.wide, mid.tile_m, mid.tile_n, mid.token_step, mid.scheduler, mid.expert_split) == (
                True, 160, 256, 32, s90.Scheduler.STATIC, s90.ExpertSplit.EVEN), (problem, rows)
            assert s90.default_overrides_tuning(problem, rows)
    gpt_oss1 = s90.Sm90Problem(G1, 5760, 2880, 128, torch.bfloat16, Activation.SWIGLU_OAI, True)
    assert not s90.default_config(gpt_oss1, rows_per_expert=128).wide  # N fits no 256-row tile: regular
    assert s90.default_overrides_tuning(mixtral2, hi288) and s90.default_overrides_tuning(gpt_oss1, hi288)
    assert not s90.default_overrides_tuning(mixtral1, hi288 + 1) and not s90.default_overrides_tuning(p2, None)
    assert not s90.default_overrides_tuning(p2, 256)
    many = s90.regular_config(p2, rows_per_expert=s90.SWAPPED_MAX_ROWS_PER_EXPERT + 1)
    assert (many.operands, many.scheduler, many.raster) == (s90.Operands.TOKENS_AS_M, s90.Scheduler.DYNAMIC,
                                                            s90.Raster.ALONG_N)
    assert s90.regular_config(p2, rows_per_expert=s90.GROUPED_RASTER_MIN_ROWS).raster is s90.Raster.ALONG_N
    # above GROUPED_RASTER_MIN_ROWS: ALONG_N up to ALONG_N_MAX_ROWS on few n-blocks (p2: 8), GROUPED_M beyond, on
    # many n-blocks (mixtral-8x7b GEMM1: 112) or for an unknown estimate
    mixtral1 = s90.Sm90Problem(G1, 28672, 4096, 8, torch.bfloat16, Activation.SWIGLU)
    for rows in (max(hi, s90.GROUPED_RASTER_MIN_ROWS) + 1, s90.ALONG_N_MAX_ROWS):
        along_n = s90.default_config(p2, rows_per_expert=rows)
        assert (along_n.operands, along_n.scheduler, along_n.raster) == (
            s90.Operands.TOKENS_AS_M, s90.Scheduler.DYNAMIC, s90.Raster.ALONG_N), rows
    for problem, rows in ((p2, s90.ALONG_N_MAX_ROWS + 1), (p2, None)):
        grouped = s90.default_config(problem, rows_per_expert=rows)
        assert (grouped.scheduler, grouped.raster, grouped.raster_group_m) == (
            s90.Scheduler.DYNAMIC, s90.Raster.GROUPED_M, s90.GROUPED_RASTER_GROUP_M), (problem, rows)
    # GEMM1 (v15): EXPERT_GROUPED_M with SKIP where the regular kernel runs DYNAMIC SINGLE units on at most
    # GEMM1_EXPERT_GROUPED_MAX_ROWS rows per expert, on few n-blocks (p1: 6) and many (mixtral1: 112); above it and for
    # an unknown estimate GEMM2's rule (GROUPED_M, MULTIPLY); an explicit STATIC scheduler or PAIR units keep ALONG_N
    # and MULTIPLY
    top = s90.GEMM1_EXPERT_GROUPED_MAX_ROWS
    for problem, rows in ((p1, s90.SWAPPED_MAX_ROWS_PER_EXPERT + 1), (p1, 300), (p1, top), (mixtral1, 300),
                          (mixtral1, top)):
        g1 = s90.default_config(problem, rows_per_expert=rows)
        assert (g1.operands, g1.scheduler, g1.raster, g1.raster_group_m, g1.padding_rows) == (
            s90.Operands.TOKENS_AS_M, s90.Scheduler.DYNAMIC, s90.Raster.EXPERT_GROUPED_M, s90.GROUPED_RASTER_GROUP_M,
            s90.PaddingRows.SKIP), (problem, rows)
        assert s90.can_implement(g1, problem) == (True, "")
    for problem, rows in ((p1, top + 1), (p1, 4096), (p1, None), (mixtral1, top + 1), (mixtral1, None)):
        g1 = s90.default_config(problem, rows_per_expert=rows)
        assert (g1.scheduler, g1.raster, g1.padding_rows) == (
            s90.Scheduler.DYNAMIC, s90.Raster.GROUPED_M, s90.PaddingRows.MULTIPLY), (problem, rows)
    for g1 in (s90.default_config(p1, s90.Scheduler.STATIC, rows_per_expert=256),
               s90.default_config(p1, work_unit=WorkUnit.PAIR, rows_per_expert=256)):
        assert (g1.raster, g1.padding_rows) == (s90.Raster.ALONG_N, s90.PaddingRows.MULTIPLY), g1
    assert s90.regular_schedule(WorkUnit.SINGLE, 256, n_blocks=6, stage=G1)[1] is s90.Raster.EXPERT_GROUPED_M
    assert s90.regular_schedule(WorkUnit.SINGLE, 256, n_blocks=6, stage=G2)[1] is s90.Raster.ALONG_N
    assert s90.regular_schedule(WorkUnit.SINGLE, 256, n_blocks=s90.ALONG_N_MAX_N_BLOCKS + 1)[1] is s90.Raster.GROUPED_M
    assert s90.regular_schedule(WorkUnit.SINGLE, 256, n_blocks=s90.ALONG_N_MAX_N_BLOCKS)[1] is s90.Raster.ALONG_N
    # an explicit STATIC scheduler keeps ALONG_N; PAIR units run STATIC by default (measured: see regular_schedule)
    assert s90.default_config(p2, s90.Scheduler.STATIC).raster is s90.Raster.ALONG_N
    assert s90.default_config(p2, work_unit=WorkUnit.PAIR).scheduler is s90.Scheduler.STATIC
    # a pair request keeps the regular kernel; the scheduler request carries over to the swapped one
    assert s90.default_config(p2, work_unit=WorkUnit.PAIR, rows_per_expert=1).operands is s90.Operands.TOKENS_AS_M
    assert s90.default_config(p2, s90.Scheduler.DYNAMIC, rows_per_expert=1).scheduler is s90.Scheduler.DYNAMIC
    key = s90.kernel_key(few, p2)
    assert "operands" in key.file_stem() and key != s90.kernel_key(s90.default_config(p2), p2)


def test_grouped_raster_limits_and_key():
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    grouped = s90.Sm90GemmConfig(raster=s90.Raster.GROUPED_M, raster_group_m=4)
    assert s90.can_implement(grouped, p1) == (True, "")
    ok, why = s90.can_implement(dataclasses.replace(grouped, raster_group_m=0), p1)
    assert not ok and "raster_group_m" in why
    ok, why = s90.can_implement(dataclasses.replace(grouped, tile_m=16, tile_n=128, operands=s90.Operands.WEIGHTS_AS_M), p1)
    assert not ok and "GROUPED_M" in why
    # the group size is part of the key only for GROUPED_M (existing ALONG_N / ALONG_M bundles keep their names)
    stems = {s90.kernel_key(dataclasses.replace(grouped, raster_group_m=g), p1).file_stem() for g in (4, 8)}
    assert len(stems) == 2 and all("group" in stem for stem in stems)
    along_n = s90.Sm90GemmConfig()
    assert s90.kernel_key(along_n, p1) == s90.kernel_key(dataclasses.replace(along_n, raster_group_m=3), p1)
    # EXPERT_GROUPED_M: the same group limits, SINGLE units only, its own key (with the group size)
    by_expert = dataclasses.replace(grouped, raster=s90.Raster.EXPERT_GROUPED_M)
    assert s90.can_implement(by_expert, p1) == (True, "")
    ok, why = s90.can_implement(dataclasses.replace(by_expert, work_unit=WorkUnit.PAIR), p1)
    assert not ok and why.startswith("raster: EXPERT_GROUPED_M needs SINGLE"), why
    ok, why = s90.can_implement(dataclasses.replace(by_expert, raster_group_m=65), p1)
    assert not ok and "raster_group_m" in why
    key = s90.kernel_key(by_expert, p1).file_stem()
    assert "rasterexpert-grouped-m_group4" in key and key != s90.kernel_key(grouped, p1).file_stem()


def test_padding_rows_limits_and_key():
    """PaddingRows.SKIP splits a 128-row tile between two COOPERATIVE warpgroups; it is a key part only when set."""
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    skip = s90.Sm90GemmConfig(scheduler=s90.Scheduler.DYNAMIC, raster=s90.Raster.GROUPED_M,
                              padding_rows=s90.PaddingRows.SKIP)
    assert s90.can_implement(skip, p1) == (True, "")
    for bad in (dataclasses.replace(skip, tile_m=64), dataclasses.replace(skip, tile_n=128, consumers=s90.Consumers.PINGPONG),
                dataclasses.replace(skip, tile_m=16, tile_n=128, raster=s90.Raster.ALONG_N,
                                    operands=s90.Operands.WEIGHTS_AS_M)):
        ok, why = s90.can_implement(bad, p1)
        assert not ok and why.startswith("padding_rows: SKIP needs COOPERATIVE"), why
    multiply = dataclasses.replace(skip, padding_rows=s90.PaddingRows.MULTIPLY)
    assert s90.kernel_key(skip, p1).file_stem() == s90.kernel_key(multiply, p1).file_stem() + "_paddingskip"


def test_fuse_tail_limits_stages_and_key():
    """PaddingRows.FUSE_TAIL: SINGLE COOPERATIVE 128-row tiles of tile_k 64 on the gathered copy, AFTER_MAINLOOP stores;
    its stages hold 192 A rows (an m-block and a tail's 64), and it is a key part."""
    p1 = s90.Sm90Problem(G1, 4096, 7168, 256, torch.bfloat16, Activation.SWIGLU)
    fuse = s90.Sm90GemmConfig(scheduler=s90.Scheduler.DYNAMIC, raster=s90.Raster.EXPERT_GROUPED_M,
                              padding_rows=s90.PaddingRows.FUSE_TAIL)
    assert s90.can_implement(fuse, p1) == (True, "")
    assert s90.unit_rows(fuse) == 192 and s90.resolve_stages(fuse) == 3  # 56 KB a stage beside the epilogue
    assert s90.smem_bytes(fuse, 3) <= s90.ARCH_LIMITS[s90.Arch.SM90].smem_per_cta
    for bad in (dataclasses.replace(fuse, tile_m=64), dataclasses.replace(fuse, tile_k=128),
                dataclasses.replace(fuse, work_unit=WorkUnit.PAIR, raster=s90.Raster.GROUPED_M),
                dataclasses.replace(fuse, a_source=s90.ASource.TOKEN_ROWS),
                dataclasses.replace(fuse, epilogue_store=s90.EpilogueStore.UNDER_NEXT_MAINLOOP),
                dataclasses.replace(fuse, tile_n=128, consumers=s90.Consumers.PINGPONG)):
        ok, why = s90.can_implement(bad, p1)
        assert not ok and why.startswith("padding_rows: FUSE_TAIL needs"), (bad, why)
    p2 = s90.Sm90Problem(G2, 7168, 2048, 256, torch.bfloat16, None, False, True)
    ok, why = s90.can_implement(dataclasses.replace(fuse, tile_n=16), p2)  # 8 tail columns per warpgroup: too few
    assert not ok and why.startswith("padding_rows: FUSE_TAIL needs"), why
    split = dataclasses.replace(fuse, padding_rows=s90.PaddingRows.SPLIT_TAIL)
    assert s90.can_implement(split, p1) == (True, "") and s90.resolve_stages(split) == 3
    ok, why = s90.can_implement(dataclasses.replace(split, tile_n=32), p2)  # a quarter of 32 columns: too few
    assert not ok and why.startswith("padding_rows: SPLIT_TAIL needs"), why
    # gpt-oss GEMM1 on 192-wide tiles: 24-column tail slices, whose 8-column store sub-tiles measured wrong on the H200
    p1_oai = s90.Sm90Problem(G1, 5760, 2880, 128, torch.bfloat16, Activation.SWIGLU_OAI, has_bias=True)
    ok, why = s90.can_implement(dataclasses.replace(split, tile_n=192), p1_oai)
    assert not ok and "got 96" in why, why
    assert s90.can_implement(dataclasses.replace(fuse, tile_n=192), p1_oai) == (True, "")
    skip = dataclasses.replace(fuse, padding_rows=s90.PaddingRows.SKIP)
    assert s90.kernel_key(fuse, p1).file_stem().endswith("_stages3_scheddynamic_rasterexpert-grouped-m_group8"
                                                        "_paddingfuse-tail")
    assert s90.kernel_key(skip, p1).file_stem().endswith("_stages4_scheddynamic_rasterexpert-grouped-m_group8"
                                                        "_paddingskip")


def test_direct_store_kernels_give_way_where_their_offsets_would_overflow():
    """The WEIGHTS_AS_M kernels store C with 32-bit element offsets: where the output has more than 2**31 - 1
    elements, config_for_rows takes the regular (TMA-store) kernel instead; below, default_config's choice."""
    problem = s90.Sm90Problem(GemmStage.GEMM2, 7168, 2048, 256, torch.bfloat16, None, False, True)
    small = s90.config_for_rows(problem, 16.0, 16 * 256 + 256 * 127)
    assert small == s90.default_config(problem, rows_per_expert=16.0)
    assert small.operands is s90.Operands.WEIGHTS_AS_M
    rows = (2**31 - 1) // 7168 + 1
    large = s90.config_for_rows(problem, 16.0, rows)
    assert large.operands is s90.Operands.TOKENS_AS_M and s90.can_implement(large, problem)[0]
    assert s90.config_for_rows(problem, 16.0, rows - 1).operands is s90.Operands.WEIGHTS_AS_M
    with pytest.raises(ValueError, match="^rows: expected"):
        s90.config_for_rows(problem, 16.0, -1)
    with pytest.raises(TypeError, match="^problem: expected"):
        s90.config_for_rows(None, 16.0, 10)
    with pytest.raises(ValueError, match="^device: expected a CUDA"):
        s90.persistent_ctas(torch.device("cpu"), 1)


def test_kernel_key_is_static_and_filesystem_safe():
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    key = s90.kernel_key(s90.Sm90GemmConfig(pair_threshold=1), p1)
    assert key == s90.kernel_key(s90.Sm90GemmConfig(pair_threshold=999), p1)  # runtime value, not a key
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", key.file_stem())
    assert re.fullmatch(r"[A-Za-z0-9_]+", key.function_name())
    other = s90.kernel_key(s90.Sm90GemmConfig(work_unit=WorkUnit.PAIR), p1)
    assert other.file_stem() != key.file_stem()


def test_kernel_dir_reads_env_at_call_time(monkeypatch, tmp_path):
    monkeypatch.delenv(rt.KERNEL_DIR_ENV, raising=False)
    assert rt.kernel_dir() is None
    monkeypatch.setenv(rt.KERNEL_DIR_ENV, str(tmp_path))
    assert rt.kernel_dir() == tmp_path
    assert rt.kernel_dir("/x") == rt.kernel_dir("/x")


def test_kernel_cache_explains_how_to_build(monkeypatch, tmp_path):
    monkeypatch.setenv(rt.KERNEL_DIR_ENV, str(tmp_path))
    key = rt.KernelKey("sm90_grouped_gemm", "sm_90a", "bfloat16", 256, 128, 8, (128, 128, 64), (1, 1, 1), "swiglu")
    with pytest.raises(RuntimeError, match="moe2cta.aot build"):
        rt.KernelCache().get(key, None)
    with pytest.raises(FileNotFoundError, match=key.file_stem()):
        rt.load_kernel(key, tmp_path)


def test_aot_cli_rejects_unknown_model():
    from moe2cta import aot

    with pytest.raises(ValueError, match="model"):
        aot.build("no-such-model", "sm_90a", "/tmp/unused")


def test_config_and_problem_fields_are_typed():
    """A float or bool where an int belongs is refused when the config is made (64.0 hashes like 64, so the memoized
    can_implement / kernel_key would serve one's answer for the other); enum fields given as strings are refused by
    can_implement, by name; a problem's sizes are ints >= 1 and its kind a GemmStage."""
    for field, value in (("tile_k", 64.0), ("token_step", True), ("pair_threshold", None), ("pair_threshold", 300.7)):
        with pytest.raises(TypeError, match=f"^{field}: expected an int"):
            s90.Sm90GemmConfig(**{field: value})
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    for field, value in (("work_unit", "pair"), ("scheduler", "dynamic"), ("raster", "grouped_m"),
                         ("padding_rows", "skip"), ("consumers", "pingpong"), ("operands", "weights_as_m")):
        ok, why = s90.can_implement(s90.Sm90GemmConfig(**{field: value}), p1)
        assert not ok and why.startswith(f"{field}: expected a"), why
    with pytest.raises(TypeError, match="^kind: expected a GemmStage"):
        s90.Sm90Problem("gemm1", 1536, 2048, 128)
    for sizes, name in (((0, 2048, 128), "n"), ((1536, 0, 128), "k"), ((1536, 2048, 0), "num_experts"),
                        ((1536.0, 2048, 128), "n")):
        with pytest.raises(ValueError, match=f"^{name}: expected an int >= 1"):
            s90.Sm90Problem(G1, *sizes)
    with pytest.raises(ValueError, match="^problem: no sm90 configuration fits .*the last candidate's limit"):
        s90.regular_config(s90.Sm90Problem(G2, 2048, 100, 128))  # K not a multiple of 8


def test_device_tables_take_a_device_with_or_without_its_index(monkeypatch):
    """"cuda" is the current CUDA device in every per-device table (prepare_device's scratch, the SM counts, the class
    bounds, the L2 side maps), so a device named either way finds one entry."""
    from moe2cta.grouped_gemm import l2_sides

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert l2_sides.device_key("cuda") == l2_sides.device_key(torch.device("cuda", 3)) == ("cuda", 3)
    assert l2_sides.device_key("cpu") == ("cpu", None)
    for device in ("cpu", "meta", 0):  # (0: torch's "current accelerator", refused as not a device or a name)
        with pytest.raises(ValueError, match="^device: expected a CUDA device"):
            s90.persistent_ctas(device, 1)
    monkeypatch.setitem(s90._SM_COUNTS, ("cuda", 3), 132)
    assert s90.persistent_ctas("cuda", 2) == s90.persistent_ctas(torch.device("cuda", 3), 2) == 132
    for cluster_m in (True, 2.0, 3):
        with pytest.raises(ValueError, match="^cluster_m"):
            s90.persistent_ctas(torch.device("cuda", 3), cluster_m)


def test_can_implement_refuses_what_the_kernels_cannot_compute():
    """Two configurations the checks let through before stop 52: a wide WEIGHTS_AS_M tile on the gathered copy at
    tile_k 128 (its 64-row token boxes are staged box after box, which the wgmma's K-major view of the whole tile
    matches for one 64-column swizzle atom only: every unit wrong once K > 64), and a GEMM1 output tile of 8 columns
    (tile_n 16: narrower than the MMA's output atom, failed to compile)."""
    for kind, n, k, activation, row_scale in ((G1, 4096, 2048, Activation.SWIGLU, False), (G2, 2048, 2048, None, True)):
        problem = s90.Sm90Problem(kind, n, k, 64, torch.bfloat16, activation, False, row_scale)
        for tile_m, tile_n in ((128, 128), (160, 256), (288, 128)):
            wide = s90.Sm90GemmConfig(tile_m=tile_m, tile_n=tile_n, tile_k=128, operands=s90.Operands.WEIGHTS_AS_M,
                                      token_step=32)
            ok, why = s90.can_implement(wide, problem)
            assert not ok and "tile_k: a wide WEIGHTS_AS_M tile on the gathered copy takes tile_k 32 or 64" in why
            assert s90.can_implement(dataclasses.replace(wide, tile_k=64), problem) == (True, "")
    problem = s90.Sm90Problem(G1, 4096, 2048, 64, torch.bfloat16, Activation.SWIGLU, False, False)
    for consumers in (s90.Consumers.COOPERATIVE, s90.Consumers.PINGPONG):
        ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_n=16, consumers=consumers), problem)
        assert not ok and "output tile 8 is below 16 columns" in why
    assert s90.can_implement(s90.Sm90GemmConfig(tile_n=32), problem) == (True, "")


def test_row_alignment_is_what_each_kernel_needs_of_the_dispatchs_align():
    """The regular kernel's m-block, a wide tile's 64-row box start, a decode tile's rows: 128 (the dispatch's
    default align) serves every kernel the presets build."""
    assert s90.row_alignment(s90.Sm90GemmConfig()) == 128
    assert s90.row_alignment(s90.Sm90GemmConfig(tile_m=64, tile_n=128)) == 64
    wide = s90.Sm90GemmConfig(tile_m=160, tile_n=256, operands=s90.Operands.WEIGHTS_AS_M, token_step=32)
    assert wide.wide and s90.row_alignment(wide) == s90.WIDE_ROW_ALIGN == 64
    decode = s90.Sm90GemmConfig(tile_m=16, tile_n=128, tile_k=128, operands=s90.Operands.WEIGHTS_AS_M)
    assert not decode.wide and s90.row_alignment(decode) == 16
    for preset in PRESETS.values():
        for config, _ in s90.preset_configs(preset):
            assert 128 % s90.row_alignment(config) == 0, config


def test_check_out_refuses_an_out_that_shares_memory_with_a():
    """Every block of A is read by several CTAs while others store C (and a PAIR's unstored half reads a neighbour's
    rows): an `out` overlapping `a` would feed them outputs. Both families' wrappers check it (check_out)."""
    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^out: expected memory of its own, got one that overlaps a"):
        s90.check_out(a, 256, 128, a)
    with pytest.raises(ValueError, match="overlaps a"):
        s90.check_out(a[128:], 128, 128, a[:200])
    s90.check_out(torch.empty(256, 128, dtype=torch.bfloat16), 256, 128, a)  # its own memory
    s90.check_out(a[128:], 128, 128, a[:128])  # adjacent, not overlapping
    # nor with any other operand the kernel reads, named; a KernelBias by its values
    w = torch.zeros(2, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="overlaps w2"):
        s90.check_out(w[1], 256, 128, a, w2=w, row_scale=None)
    scale = torch.zeros(300 * 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="overlaps row_scale"):  # out's first row holds row_scale's last entries
        s90.check_out(scale[256:].view(torch.bfloat16)[: 256 * 128].view(256, 128), 256, 128, a, row_scale=scale[:300])
    bias = s90.kernel_bias(s90.GemmStage.GEMM2, torch.zeros(2, 128))
    with pytest.raises(ValueError, match="overlaps b2"):
        s90.check_out(bias.values.view(torch.bfloat16).view(-1)[:256].view(2, 128), 2, 128,
                      torch.zeros(2, 64, dtype=torch.bfloat16), b2=bias)
    # a strided operand reaches to its last element, past its element count
    strided = torch.zeros(512, 128, dtype=torch.bfloat16)[::2]
    last_rows = torch.as_strided(strided, (2, 128), (128, 1), 128 * 509)  # rows 509-510 of the base: inside the reach
    with pytest.raises(ValueError, match="overlaps a_rows"):
        s90.check_out(last_rows, 2, 128, a, a_rows=strided)
    s90.check_out(torch.as_strided(strided, (1, 128), (128, 1), 128 * 511), 1, 128, a, a_rows=strided)  # past it
