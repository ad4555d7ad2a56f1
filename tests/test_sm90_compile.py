"""CPU tier of the sm90 CuTe grouped GEMM: compile for sm_90a and read the PTX (the host side, the configuration
layer's limits and the policies: tests/test_sm90_config.py; the limits of the token-row, wide, fused-tail and
ping-pong kernels stay beside their compile tests here).

No GPU needed. The compile tests need nvidia-cutlass-dsl (skipped with a reason otherwise): one small
kernel per epilogue / work unit / scheduler, and every kernel of every model preset's bundle at its real size,
each checked for wgmma.mma_async, TMA loads (cp.async.bulk.tensor, .multicast::cluster for pair units), mbarrier
waits and TMA stores (or its kind's loads and stores); one is exported as a bundle entry (shared library + PTX +
manifest).
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

from moe2cta.grouped_gemm import Activation, GemmStage
from moe2cta.grouped_gemm import cute_runtime as rt
from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
from moe2cta.grouped_gemm.budget import WorkUnit
from moe2cta.presets import PRESETS

G1, G2 = GemmStage.GEMM1, GemmStage.GEMM2
NEEDS_DSL = pytest.mark.skipif(not rt.dsl_available(), reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")


def _ptxas() -> str | None:
    """The ptxas Triton ships (every install of the project has it), else one on PATH."""
    try:
        import triton.backends.nvidia as nvidia_backend
    except ImportError:
        nvidia_backend = None
    if nvidia_backend is not None:
        bundled = pathlib.Path(nvidia_backend.__file__).parent / "bin" / "ptxas"
        if bundled.is_file():
            return str(bundled)
    return shutil.which("ptxas")


def _ptxas_report(ptx: str, tmp_path) -> str:
    """ptxas -v of one kernel's PTX for sm_90a: the compiler's info lines (registers, spills, C75xx notes)."""
    source, cubin = tmp_path / "kernel.ptx", tmp_path / "kernel.cubin"
    source.write_text(ptx)
    done = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", str(source), "-o", str(cubin)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr


# ---------------------------------------------------------------------------------------------- fused tails
FUSE_TAIL = [  # (name, config, problem): PaddingRows.FUSE_TAIL kernels (cute_fused_tail_backend.py)
    ("fuse_swiglu_n256_expert_grouped_dynamic", s90.Sm90GemmConfig(
        scheduler=s90.Scheduler.DYNAMIC, raster=s90.Raster.EXPERT_GROUPED_M, padding_rows=s90.PaddingRows.FUSE_TAIL),
     s90.Sm90Problem(G1, 4096, 7168, 256, torch.bfloat16, Activation.SWIGLU)),
    ("fuse_oai_bias_n192_dynamic", s90.Sm90GemmConfig(
        tile_n=192, scheduler=s90.Scheduler.DYNAMIC, padding_rows=s90.PaddingRows.FUSE_TAIL),
     s90.Sm90Problem(G1, 5760, 2880, 128, torch.bfloat16, Activation.SWIGLU_OAI, has_bias=True)),
    ("fuse_rowscale_n256_along_n", s90.Sm90GemmConfig(padding_rows=s90.PaddingRows.FUSE_TAIL),
     s90.Sm90Problem(G2, 7168, 2048, 256, torch.bfloat16, None, False, True)),
    ("split_swiglu_n256_expert_grouped_dynamic", s90.Sm90GemmConfig(
        scheduler=s90.Scheduler.DYNAMIC, raster=s90.Raster.EXPERT_GROUPED_M, padding_rows=s90.PaddingRows.SPLIT_TAIL),
     s90.Sm90Problem(G1, 4096, 7168, 256, torch.bfloat16, Activation.SWIGLU)),
    ("split_rowscale_bias_n192_dynamic", s90.Sm90GemmConfig(
        tile_n=192, scheduler=s90.Scheduler.DYNAMIC, padding_rows=s90.PaddingRows.SPLIT_TAIL),
     s90.Sm90Problem(G2, 2880, 2880, 128, torch.bfloat16, None, True, True)),
]


@NEEDS_DSL
@pytest.mark.parametrize("name,config,problem", FUSE_TAIL, ids=[s[0] for s in FUSE_TAIL])
def test_compile_fuse_tail_and_check_ptx(name, config, problem, tmp_path):
    """Each warpgroup's m64 x tile_n MMA and, for fused units, the tail's m64 x (a slice of tile_n) one; A by 64-row TMA boxes
    with per-unit transaction bytes. ptxas keeps the wgmma pipelined (no C7519 / C7520) and spills at most a
    few bytes (GEMM2's row scale: 12)."""
    ptx = s90.compile_kernel(config, problem, keep_ptx=True).__ptx__
    _check_ptx(ptx, False, config.scheduler is s90.Scheduler.DYNAMIC)
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    parts = 2 if config.padding_rows is s90.PaddingRows.SPLIT_TAIL else 1
    assert shapes == {f"m64n{config.tile_n}k16", f"m64n{config.tile_n // (2 * parts)}k16"}, shapes
    assert "mbarrier.arrive.expect_tx" in ptx
    assert ".reqntid 384" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t232" in ptx
    if _ptxas() is not None:
        report = _ptxas_report(ptx, tmp_path)
        assert "C7520" not in report and "C7519" not in report, report
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", report)]
        assert spills and max(spills) <= 16, report


# ---------------------------------------------------------------------------------------------- compile
SMALL = [  # (name, config, problem): one per epilogue, work unit and scheduler
    ("swiglu_pair", s90.Sm90GemmConfig(tile_n=128, work_unit=WorkUnit.PAIR), s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU)),
    ("gelu_single_fp16", s90.Sm90GemmConfig(tile_n=128, work_unit=WorkUnit.SINGLE),
     s90.Sm90Problem(G1, 256, 128, 4, torch.float16, Activation.GELU_GATED)),
    ("oai_bias_dynamic", s90.Sm90GemmConfig(tile_n=128, work_unit=WorkUnit.SINGLE, scheduler=s90.Scheduler.DYNAMIC),
     s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU_OAI, has_bias=True)),
    ("rowscale_bias_pair", s90.Sm90GemmConfig(tile_n=128, work_unit=WorkUnit.PAIR), s90.Sm90Problem(G2, 256, 128, 4, torch.bfloat16, None, True, True)),
    ("plain_m64", s90.Sm90GemmConfig(tile_m=64, tile_n=64, work_unit=WorkUnit.SINGLE), s90.Sm90Problem(G2, 128, 64, 4)),
    ("rowscale_grouped_dynamic", s90.Sm90GemmConfig(tile_n=128, scheduler=s90.Scheduler.DYNAMIC, raster=s90.Raster.GROUPED_M,
                                                    raster_group_m=3), s90.Sm90Problem(G2, 256, 128, 4, torch.bfloat16, None, False, True)),
    ("rowscale_bias_skip_grouped_dynamic", s90.Sm90GemmConfig(tile_n=256, scheduler=s90.Scheduler.DYNAMIC,
                                                              raster=s90.Raster.GROUPED_M, raster_group_m=3,
                                                              padding_rows=s90.PaddingRows.SKIP),
     s90.Sm90Problem(G2, 256, 128, 4, torch.bfloat16, None, True, True)),
    ("rowscale_bias_expert_grouped_dynamic", s90.Sm90GemmConfig(tile_n=256, scheduler=s90.Scheduler.DYNAMIC,
                                                                raster=s90.Raster.EXPERT_GROUPED_M, raster_group_m=4),
     s90.Sm90Problem(G2, 256, 128, 4, torch.bfloat16, None, True, True)),
    ("swiglu_pair_dynamic", s90.Sm90GemmConfig(tile_n=128, work_unit=WorkUnit.PAIR, scheduler=s90.Scheduler.DYNAMIC,
                                               raster=s90.Raster.GROUPED_M, raster_group_m=4),
     s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU)),
    # EpilogueStore.UNDER_NEXT_MAINLOOP: sub-tile stores between a K tile's wgmma commit and its wait
    ("oai_bias_under_skip_dynamic", s90.Sm90GemmConfig(tile_n=128, scheduler=s90.Scheduler.DYNAMIC,
                                                       padding_rows=s90.PaddingRows.SKIP,
                                                       epilogue_store=s90.EpilogueStore.UNDER_NEXT_MAINLOOP),
     s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU_OAI, has_bias=True)),
    ("rowscale_bias_under_n256_grouped_dynamic", s90.Sm90GemmConfig(
        tile_n=256, scheduler=s90.Scheduler.DYNAMIC, raster=s90.Raster.GROUPED_M, raster_group_m=3,
        padding_rows=s90.PaddingRows.SKIP, epilogue_store=s90.EpilogueStore.UNDER_NEXT_MAINLOOP),
     s90.Sm90Problem(G2, 256, 128, 4, torch.bfloat16, None, True, True)),
    # a partial last n-block (N = 384 on 256-wide tiles), with the bias index clamped
    ("oai_bias_n256_tail_under_dynamic", s90.Sm90GemmConfig(tile_n=256, scheduler=s90.Scheduler.DYNAMIC,
                                                            epilogue_store=s90.EpilogueStore.UNDER_NEXT_MAINLOOP),
     s90.Sm90Problem(G1, 384, 128, 4, torch.bfloat16, Activation.SWIGLU_OAI, has_bias=True)),
    # EpilogueStore.ACTIVATION_UNDER_NEXT_MAINLOOP: GEMM1's activation math under the next unit's K tiles too
    ("oai_bias_act_under_skip_dynamic", s90.Sm90GemmConfig(tile_n=128, scheduler=s90.Scheduler.DYNAMIC,
                                                           padding_rows=s90.PaddingRows.SKIP,
                                                           epilogue_store=s90.EpilogueStore.ACTIVATION_UNDER_NEXT_MAINLOOP),
     s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU_OAI, has_bias=True)),
    ("swiglu_act_under_fp16_pair", s90.Sm90GemmConfig(tile_n=256, work_unit=WorkUnit.PAIR,
                                                      epilogue_store=s90.EpilogueStore.ACTIVATION_UNDER_NEXT_MAINLOOP),
     s90.Sm90Problem(G1, 512, 128, 4, torch.float16, Activation.SWIGLU)),
]


def _check_ptx(ptx: str, multicast: bool, dynamic: bool):
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx  # TMA load of the token tile (A)
    assert re.search(r"cp\.async\.bulk\.tensor\.3d\.shared::\w+\.global", ptx)  # TMA load of the weight tile (B)
    assert "mbarrier.try_wait" in ptx
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx  # TMA store of the epilogue
    assert ("multicast::cluster" in ptx) == multicast
    assert ("atom.global" in ptx or "red.global" in ptx) == dynamic


@NEEDS_DSL
@pytest.mark.parametrize("name,config,problem", SMALL, ids=[s[0] for s in SMALL])
def test_compile_small_and_check_ptx(name, config, problem):
    compiled = s90.compile_kernel(config, problem, keep_ptx=True)
    ptx = compiled.__ptx__
    pair, dynamic = config.work_unit is WorkUnit.PAIR, config.scheduler is s90.Scheduler.DYNAMIC
    _check_ptx(ptx, pair, dynamic)
    # DYNAMIC clusters: rank 0 stores each unit into rank 1's slot (st.async, completing rank 1's barrier by
    # bytes) and the readers of both CTAs release the slot on rank 0's barrier (remote arrive)
    assert ("st.async.shared::cluster.mbarrier::complete_tx::bytes" in ptx) == (pair and dynamic)
    if pair and dynamic:
        assert "mbarrier.arrive.shared::cluster" in ptx


DEPENDENT_LAUNCH_KERNELS = [  # (name, config, problem): the decode, wide, regular and fused-tail kernels
    ("swapped16", s90.Sm90GemmConfig(tile_m=16, tile_n=128, tile_k=128, operands=s90.Operands.WEIGHTS_AS_M),
     s90.Sm90Problem(G1, 256, 256, 8, torch.bfloat16, Activation.SWIGLU)),
    ("wide160_token_rows", s90.Sm90GemmConfig(tile_m=160, tile_n=256, tile_k=64, operands=s90.Operands.WEIGHTS_AS_M,
                                              token_step=32, a_source=s90.ASource.TOKEN_ROWS),
     s90.Sm90Problem(G1, 512, 256, 8, torch.bfloat16, Activation.SWIGLU)),
    ("regular_dynamic", s90.Sm90GemmConfig(tile_n=128, scheduler=s90.Scheduler.DYNAMIC),
     s90.Sm90Problem(G2, 256, 128, 4, torch.bfloat16, None, False, True)),
    ("pair", s90.Sm90GemmConfig(tile_n=128, work_unit=WorkUnit.PAIR),
     s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU)),
    ("fuse_tail", s90.Sm90GemmConfig(tile_n=128, padding_rows=s90.PaddingRows.FUSE_TAIL),
     s90.Sm90Problem(G2, 256, 128, 4, torch.bfloat16, None, False, True)),
]


@NEEDS_DSL
@pytest.mark.parametrize("name,config,problem", DEPENDENT_LAUNCH_KERNELS, ids=[k[0] for k in DEPENDENT_LAUNCH_KERNELS])
def test_dependent_launch_waits_before_its_first_input_read(name, config, problem):
    """PROGRAMMATIC: one griddepcontrol.wait, then launch_dependents, before any global load of the kernel's own code
    (its first: the dispatch metadata); PROGRAMMATIC_WEIGHT_PREFETCH: also the first unit's weight tiles into L2
    (cp.async.bulk.prefetch.tensor, by one elected lane) before the wait; a plain launch: none of them."""
    DL = s90.DependentLaunch
    launches = [DL.STREAM_ORDER, DL.PROGRAMMATIC]
    if config.padding_rows is not s90.PaddingRows.FUSE_TAIL:
        launches.append(DL.PROGRAMMATIC_WEIGHT_PREFETCH)
    for launch in launches:
        ptx = s90.compile_kernel(dataclasses.replace(config, dependent_launch=launch), problem, keep_ptx=True).__ptx__
        lines = ptx.splitlines()
        waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
        releases = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
        prefetches = [i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.tensor" in line]
        assert "wgmma.mma_async" in ptx
        if launch is DL.STREAM_ORDER:
            assert not waits and not releases and not prefetches, launch
            continue
        assert len(waits) == 1 and len(releases) == 1 and waits[0] < releases[0], launch
        loads = [i for i, line in enumerate(lines) if re.search(r"\bld\.global", line)]
        if launch is DL.PROGRAMMATIC:
            assert not prefetches
            assert loads and min(loads) > waits[0], (launch, "a global load before the wait")
        else:
            assert prefetches and max(prefetches) < waits[0], launch
            assert any(i > waits[0] for i in loads)
            # one elected lane issues the prefetches (cute.prefetch itself is issued by every thread that runs it)
            assert any("elect.sync" in line for line in lines[max(0, min(prefetches) - 40):min(prefetches)])


@NEEDS_DSL
@pytest.mark.parametrize("work_unit,a_source", [(WorkUnit.SINGLE, s90.ASource.EXPERT_ORDER_COPY),
                                                (WorkUnit.PAIR, s90.ASource.EXPERT_ORDER_COPY),
                                                (WorkUnit.SINGLE, s90.ASource.TOKEN_ROWS)])
def test_compile_dynamic_sides_reads_the_sm_id_and_two_counters(work_unit, a_source):
    """DYNAMIC_SIDES reads its SM id (%smid) for the side map and takes units from two counters (its side's, then
    the other's): more global atomics than DYNAMIC's fetch and finish count; PAIR clusters keep the st.async
    hand-over to rank 1."""
    p1 = s90.Sm90Problem(G1, 512, 256, 8, torch.bfloat16, Activation.SWIGLU)
    config = s90.Sm90GemmConfig(tile_n=128, scheduler=s90.Scheduler.DYNAMIC_SIDES, work_unit=work_unit,
                                pair_threshold=1, a_source=a_source)
    ptx = s90.compile_kernel(config, p1, keep_ptx=True).__ptx__
    dynamic_ptx = s90.compile_kernel(dataclasses.replace(config, scheduler=s90.Scheduler.DYNAMIC), p1,
                                     keep_ptx=True).__ptx__
    assert "%smid" in ptx and "%smid" not in dynamic_ptx
    atomics = len(re.findall(r"atom\.global[\w.]*\.add", ptx))
    assert atomics > len(re.findall(r"atom\.global[\w.]*\.add", dynamic_ptx)) >= 2, atomics
    assert ("st.async.shared::cluster.mbarrier::complete_tx::bytes" in ptx) == (work_unit is WorkUnit.PAIR)
    assert "wgmma.mma_async" in ptx


@NEEDS_DSL
def test_under_next_mainloop_stores_inside_the_k_loop_and_gated_epilogues_do_not_divide():
    """The UNDER_NEXT_MAINLOOP kernel issues its sub-tile stores in the unrolled first K tiles (more TMA store
    instructions and wgmma groups than AFTER_MAINLOOP), and no gated epilogue takes an IEEE division per output
    (div.rn.f32 was a third of GEMM1's time at qwen3-30b-a3b T=8192; the sigmoid takes rcp.approx)."""
    p2 = s90.Sm90Problem(G2, 2048, 768, 128, torch.bfloat16, None, False, True)
    after = dataclasses.replace(s90.default_config(p2, rows_per_expert=512.0),
                                epilogue_store=s90.EpilogueStore.AFTER_MAINLOOP)
    under = s90.default_config(p2, rows_per_expert=512.0)
    ptx_after = s90.compile_kernel(after, p2, keep_ptx=True).__ptx__
    ptx_under = s90.compile_kernel(under, p2, keep_ptx=True).__ptx__
    store = "cp.async.bulk.tensor.2d.global.shared::cta"
    assert ptx_under.count(store) > ptx_after.count(store) > 0
    assert ptx_under.count("wgmma.commit_group") > ptx_after.count("wgmma.commit_group")
    for act in (Activation.SWIGLU, Activation.SWIGLU_OAI):
        p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, act, act is Activation.SWIGLU_OAI)
        ptx = s90.compile_kernel(s90.default_config(p1, rows_per_expert=512.0), p1, keep_ptx=True).__ptx__
        assert "div.rn.f32" not in ptx and "rcp.approx" in ptx, act


@NEEDS_DSL
def test_activation_under_next_mainloop_computes_inside_the_k_loop():
    """ACTIVATION_UNDER_NEXT_MAINLOOP computes the sigmoids of the held tile's sub-tiles between a K tile's wgmma
    commit and its wait; UNDER_NEXT_MAINLOOP (the default) computes all of them after the mainloop."""
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    under = s90.default_config(p1, rows_per_expert=512.0)
    assert under.epilogue_store is s90.EpilogueStore.UNDER_NEXT_MAINLOOP
    act = dataclasses.replace(under, epilogue_store=s90.EpilogueStore.ACTIVATION_UNDER_NEXT_MAINLOOP)

    def sigmoids_between_commit_and_wait(ptx: str) -> int:
        count, open_group = 0, False
        for line in ptx.splitlines():
            if "wgmma.commit_group" in line:
                open_group = True
            elif "wgmma.wait_group" in line:
                open_group = False
            elif open_group and "ex2.approx" in line:
                count += 1
        return count

    ptx_act = s90.compile_kernel(act, p1, keep_ptx=True).__ptx__
    ptx_under = s90.compile_kernel(under, p1, keep_ptx=True).__ptx__
    # 128x256 tile, 256 consumer threads: 64 outputs each, one sigmoid per output in the unrolled K tiles
    assert sigmoids_between_commit_and_wait(ptx_act) >= 64
    assert sigmoids_between_commit_and_wait(ptx_under) == 0
    assert "div.rn.f32" not in ptx_act


@NEEDS_DSL
@pytest.mark.parametrize("model", sorted(PRESETS))
def test_compile_every_preset_kernel(model):
    """Every kernel a preset's bundle holds (s90.preset_configs: what `moe2cta aot build --model` compiles), at its
    real size, with the PTX checks of its kind: the regular kernels (wgmma, TMA loads of A and of the weight tile,
    .multicast::cluster exactly for PAIR units, mbarrier waits, the TMA store, the work counter's atomics exactly
    for DYNAMIC), the decode kernels (weights as wgmma M), the wide tiles and the kernels reading the token rows."""
    configs = s90.preset_configs(PRESETS[model])
    kinds = {"pair": 0, "regular": 0, "swapped": 0, "wide": 0, "token_rows": 0}
    for config, problem in configs:
        ptx = s90.compile_kernel(config, problem, keep_ptx=True).__ptx__
        name = s90.kernel_key(config, problem).file_stem()
        try:
            if config.a_source is s90.ASource.TOKEN_ROWS:
                _check_token_rows_ptx(ptx, config)
                kinds["token_rows"] += 1
            elif config.wide:
                _check_wide_ptx(ptx, config)
                kinds["wide"] += 1
            elif config.operands is s90.Operands.WEIGHTS_AS_M:
                _check_swapped_ptx(ptx, config)
                kinds["swapped"] += 1
            else:
                pair = config.work_unit is WorkUnit.PAIR
                _check_ptx(ptx, multicast=pair, dynamic=config.scheduler is not s90.Scheduler.STATIC)
                kinds["pair" if pair else "regular"] += 1
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error
    # what the layer runs at prefill is among them: each GEMM's GROUPED_M default, a PAIR GEMM1, GEMM1 on the token rows
    assert kinds["pair"] >= 1 and kinds["token_rows"] >= 1 and kinds["swapped"] >= 1, kinds
    prefill = [(c, p) for c, p in configs if c.raster is s90.Raster.GROUPED_M]
    assert {p.kind for c, p in prefill if c.a_source is s90.ASource.EXPERT_ORDER_COPY} == {G1, G2}


@NEEDS_DSL
@pytest.mark.skipif(_ptxas() is None, reason="no ptxas (Triton's bundled one or on PATH)")
@pytest.mark.parametrize("name,config,problem", SMALL, ids=[s[0] for s in SMALL])
def test_ptxas_keeps_wgmma_pipelined(name, config, problem, tmp_path):
    """ptxas must not serialize the wgmma instructions (note C7520: every MMA then waits for the previous one).
    It did in the PAIR kernels, where it had to insert a wgmma fence itself on a divergent path: 15-25% slower
    (results/pair-ncu-h200-2026-11-29). The mainloop now fences before each K tile's MMAs, so ptxas inserts
    none (no C7519 either), and nothing spills."""
    report = _ptxas_report(s90.compile_kernel(config, problem, keep_ptx=True).__ptx__, tmp_path)
    assert "C7520" not in report and "serialized" not in report, report
    assert "C7519" not in report, report
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", report), report


@NEEDS_DSL
@pytest.mark.skipif(_ptxas() is None, reason="no ptxas (Triton's bundled one or on PATH)")
@pytest.mark.parametrize("model", sorted(PRESETS))
def test_ptxas_keeps_preset_wgmma_pipelined(model, tmp_path):
    """The preset kernels that were serialized (the PAIR GEMM1 of qwen3 / deepseek-v3 / mixtral) and the prefill
    defaults of both GEMMs (GEMM2 with PaddingRows.SKIP) at their real sizes."""
    configs = s90.preset_configs(PRESETS[model])
    chosen = [(c, p) for c, p in configs if (c.work_unit is WorkUnit.PAIR and p.kind is G1)
              or c.raster is s90.Raster.GROUPED_M]
    assert any(c.padding_rows is s90.PaddingRows.SKIP for c, p in chosen if p.kind is G2)
    for config, problem in chosen:
        report = _ptxas_report(s90.compile_kernel(config, problem, keep_ptx=True).__ptx__, tmp_path)
        assert "C7520" not in report and "C7519" not in report, (s90.kernel_key(config, problem).file_stem(), report)


SWAPPED = [  # (name, config, problem): the decode kernel (weights as the wgmma M side)
    ("swapped16_swiglu", s90.swapped_config(s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU), 1),
     s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU)),
    ("swapped32_rowscale_bias_dynamic",
     s90.Sm90GemmConfig(tile_m=32, tile_n=64, operands=s90.Operands.WEIGHTS_AS_M, scheduler=s90.Scheduler.DYNAMIC),
     s90.Sm90Problem(G2, 256, 128, 4, torch.bfloat16, None, True, True)),
]


@NEEDS_DSL
@pytest.mark.parametrize("name,config,problem", SWAPPED, ids=[s[0] for s in SWAPPED])
def test_compile_swapped_and_check_ptx(name, config, problem, tmp_path):
    """Weights are wgmma's A (M = 64 per instruction), tokens its B (N = tile_m); stores from registers."""
    assert config.operands is s90.Operands.WEIGHTS_AS_M
    ptx = s90.compile_kernel(config, problem, keep_ptx=True).__ptx__
    _check_swapped_ptx(ptx, config)
    if _ptxas() is not None:  # the mainloop fences each K tile itself: ptxas inserts no fence (C7519), serializes nothing
        report = _ptxas_report(ptx, tmp_path)
        assert "C7520" not in report and "C7519" not in report, report


def _check_swapped_ptx(ptx: str, config):
    assert ".target sm_90a" in ptx
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    assert shapes == {f"m64n{config.tile_m}k16"}
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx  # token tile
    assert "cp.async.bulk.tensor.3d.shared::cta.global" in ptx  # weight tile (expert = 3rd mode)
    assert "mbarrier.try_wait" in ptx
    assert "multicast::cluster" not in ptx
    assert "cp.async.bulk.tensor.2d.global.shared::cta" not in ptx and "st.global" in ptx  # register stores
    assert ("atom.global" in ptx or "red.global" in ptx) == (config.scheduler is s90.Scheduler.DYNAMIC)
    assert "shfl.sync.up" in ptx  # the per-CTA prefix sum of token tiles


def test_token_rows_limits_and_key():
    """ASource.TOKEN_ROWS is GEMM1's, on the regular SINGLE COOPERATIVE kernel with whole 64-column K slices; it is a
    key part only when set, and the layer's helper picks it only where the regular kernel runs."""
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    tr = s90.token_rows_config(p1, 256.0)
    assert tr is not None and tr.a_source is s90.ASource.TOKEN_ROWS and s90.can_implement(tr, p1) == (True, "")
    assert tr == dataclasses.replace(s90.regular_config(p1, rows_per_expert=256.0), a_source=s90.ASource.TOKEN_ROWS)
    copy = dataclasses.replace(tr, a_source=s90.ASource.EXPERT_ORDER_COPY)
    key, copy_key = s90.kernel_key(tr, p1), s90.kernel_key(copy, p1)
    assert ("a_source", "token_rows") in key.extra and key != copy_key
    assert [x for x in key.extra if x != ("a_source", "token_rows")] == list(copy_key.extra)
    along_n = dataclasses.replace(tr, raster=s90.Raster.ALONG_N, padding_rows=s90.PaddingRows.MULTIPLY)
    bad = [
        (dataclasses.replace(along_n, work_unit=WorkUnit.PAIR, scheduler=s90.Scheduler.STATIC), p1, "SINGLE"),
        (dataclasses.replace(along_n, tile_n=128, consumers=s90.Consumers.PINGPONG), p1, "COOPERATIVE"),
        (dataclasses.replace(along_n, tile_m=16, tile_n=128, operands=s90.Operands.WEIGHTS_AS_M,
                             scheduler=s90.Scheduler.STATIC), p1, "TOKENS_AS_M"),
        (dataclasses.replace(tr, tile_k=32), p1, "tile_k"),
        (tr, s90.Sm90Problem(G1, 1536, 2056, 128, torch.bfloat16, Activation.SWIGLU), "dividing k"),
        (dataclasses.replace(tr, raster=s90.Raster.ALONG_N), s90.Sm90Problem(G2, 2048, 768, 128), "GEMM1"),
        (dataclasses.replace(tr, a_source="token_rows"), p1, "ASource"),
    ]
    for config, problem, needle in bad:
        ok, why = s90.can_implement(config, problem)
        assert not ok and why.startswith("a_source") and needle in why, why
    assert s90.token_rows_config(s90.Sm90Problem(G1, 1536, 2056, 128, torch.bfloat16, Activation.SWIGLU)) is None
    # the wide tiles read the token rows too (their own producer), whatever the K tiles' count on the stages (stop
    # 39's hang of the 288-row tile at 45 K tiles on 4 stages did not recur on the warp-barrier fix: stop 40); the
    # decode tiles do not
    wide = s90.default_config(p1, rows_per_expert=128.0)
    assert wide.wide and s90.token_rows_twin(wide, p1) == dataclasses.replace(wide, a_source=s90.ASource.TOKEN_ROWS)
    assert s90.can_implement(s90.token_rows_twin(wide, p1), p1) == (True, "")
    assert s90.token_rows_twin(s90.default_config(p1, rows_per_expert=8.0), p1) is None
    assert s90.token_rows_twin(wide, s90.Sm90Problem(G2, 2048, 768, 128)) is None
    with pytest.raises(TypeError, match="config, problem"):
        s90.token_rows_twin("wide160", p1)
    wide288 = s90.default_config(p1, rows_per_expert=256.0)
    assert wide288.tile_m == 288 and s90.token_rows_twin(wide288, p1) == dataclasses.replace(
        wide288, a_source=s90.ASource.TOKEN_ROWS)
    p_k2880 = s90.Sm90Problem(G1, 512, 2880, 128, torch.bfloat16, Activation.SWIGLU)  # 45 K tiles on 4 stages
    assert s90.can_implement(dataclasses.replace(wide, a_source=s90.ASource.TOKEN_ROWS), p_k2880) == (True, "")
    for preset in PRESETS.values():  # every preset bundle holds the token-row twin of each regular SINGLE / wide GEMM1
        configs = s90.preset_configs(preset)
        for cfg, problem in configs:
            if problem.kind is G1 and cfg.work_unit is WorkUnit.SINGLE and (
                    cfg.operands is s90.Operands.TOKENS_AS_M or s90.token_rows_twin(cfg, problem) is not None):
                assert (dataclasses.replace(cfg, a_source=s90.ASource.TOKEN_ROWS), problem) in configs, (preset.name, cfg)
    # the layer's AUTO choice: narrow GEMM1s (I <= 1024) on the regular kernel or the 160-row wide tile, as measured
    # (the 288-row tile on the token rows took the layer 1.25x the gathered copy's time)
    pays = {name for name, preset in PRESETS.items() if s90.token_rows_pays(
        s90.Sm90Problem(G1, 2 * preset.intermediate, preset.hidden, preset.num_experts, torch.bfloat16,
                        preset.activation, preset.has_bias), 1024.0)}
    assert pays == {"qwen3-30b-a3b"}
    qwen3 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    for rows, tile_m, expected in ((128.0, 160, True), (256.0, 288, False), (None, None, True), (1024.0, 128, True)):
        if tile_m is not None:
            assert s90.default_config(qwen3, rows_per_expert=rows).tile_m == tile_m
        assert s90.token_rows_pays(qwen3, rows) is expected, rows
    with pytest.raises(TypeError, match="problem"):
        s90.token_rows_pays("qwen3-30b-a3b", 128.0)
    assert not s90.token_rows_pays(s90.Sm90Problem(G2, 2048, 768, 128), 64)
    with pytest.raises(TypeError, match="a_rows"):
        s90._check_a_rows(torch.zeros(4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="rows_per_token"):
        s90._check_a_rows(torch.zeros(4, dtype=torch.int32), 0)


TOKEN_ROWS = [  # (name, config, problem): GEMM1 reading the token rows itself
    ("token_rows_swiglu_static", s90.Sm90GemmConfig(tile_n=128, a_source=s90.ASource.TOKEN_ROWS),
     s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU)),
    ("token_rows_oai_bias_grouped_dynamic_k128",
     s90.Sm90GemmConfig(tile_n=256, tile_k=128, scheduler=s90.Scheduler.DYNAMIC, raster=s90.Raster.GROUPED_M,
                        a_source=s90.ASource.TOKEN_ROWS),
     s90.Sm90Problem(G1, 512, 256, 4, torch.bfloat16, Activation.SWIGLU_OAI, True)),
    ("token_rows_m64_gelu", s90.Sm90GemmConfig(tile_m=64, tile_n=128, a_source=s90.ASource.TOKEN_ROWS),
     s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.GELU_GATED)),
    # the 160-row wide tile (WEIGHTS_AS_M): the layer's EVEN one, and DYNAMIC with a bias
    ("token_rows_wide160_even_swiglu",
     s90.Sm90GemmConfig(tile_m=160, tile_n=256, operands=s90.Operands.WEIGHTS_AS_M, scheduler=s90.Scheduler.STATIC,
                        raster=s90.Raster.ALONG_N, token_step=32, expert_split=s90.ExpertSplit.EVEN,
                        a_source=s90.ASource.TOKEN_ROWS),
     s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)),
    ("token_rows_wide160_oai_bias_dynamic",
     s90.Sm90GemmConfig(tile_m=160, tile_n=256, operands=s90.Operands.WEIGHTS_AS_M, scheduler=s90.Scheduler.DYNAMIC,
                        raster=s90.Raster.ALONG_N, token_step=32, a_source=s90.ASource.TOKEN_ROWS),
     s90.Sm90Problem(G1, 512, 256, 8, torch.bfloat16, Activation.SWIGLU_OAI, True)),
]


@NEEDS_DSL
@pytest.mark.parametrize("name,config,problem", TOKEN_ROWS, ids=[s[0] for s in TOKEN_ROWS])
def test_compile_token_rows_and_check_ptx(name, config, problem, tmp_path):
    """A by 16-byte cp.async (L2 only) with one .noinc arrival per producer thread on the stage's full barrier, no
    TMA load of A; B still by TMA (3-d: the expert mode), the epilogue still a TMA store; ptxas keeps the wgmma
    pipelined and spills nothing."""
    ptx = s90.compile_kernel(config, problem, keep_ptx=True).__ptx__
    _check_token_rows_ptx(ptx, config)
    if _ptxas() is not None:
        report = _ptxas_report(ptx, tmp_path)
        assert "C7520" not in report and "C7519" not in report, report
        assert "0 bytes spill stores" in report, report


def _check_token_rows_ptx(ptx: str, config):
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx
    copies = re.findall(r"cp\.async\.cg\.shared\.global(?:\.L2::\w+)? \[[^]]+\], \[[^]]+\], 16, 16;", ptx)
    assert len(copies) == (config.tile_m // 16) * (config.tile_k // 64)  # per thread and stage, unrolled
    assert "cp.async.mbarrier.arrive.noinc.shared" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cta.global" not in ptx  # no TMA load of A
    assert "cp.async.bulk.tensor.3d.shared::cta.global" in ptx  # the weight tile
    # the epilogue's TMA store (the wide tiles store 16-byte rows of their valid tokens from SMEM instead)
    assert ("cp.async.bulk.tensor.2d.global.shared::cta" in ptx) == (not config.wide)
    if config.wide:  # a row's token, written by one lane into SMEM, between two warp barriers
        assert ptx.count("bar.warp.sync") >= 2
    # (a word boundary: "cp.async.cg.shared.global" holds "red.global")
    assert bool(re.search(r"\b(atom|red)\.global", ptx)) == (config.scheduler is s90.Scheduler.DYNAMIC)


def test_expert_split_limits_and_key():
    """ExpertSplit.EVEN (an expert's rows spread evenly over its token tiles) is a wide-tile choice: the decode and
    regular kernels refuse it by name, it joins the key of EVEN kernels only (FILL kernels keep their keys), and the key
    reads back to the same configuration."""
    p1 = s90.Sm90Problem(G1, 1536, 2048, 128, torch.bfloat16, Activation.SWIGLU)
    EVEN = s90.ExpertSplit.EVEN
    for tile_m, max_n in ((288, 128), (160, 256), (256, 128), (128, 128)):
        fill = s90.wide_config(p1, tile_m=tile_m, max_tile_n=max_n)
        even = s90.wide_config(p1, tile_m=tile_m, max_tile_n=max_n, expert_split=EVEN)
        assert even == dataclasses.replace(fill, expert_split=EVEN) and s90.can_implement(even, p1) == (True, "")
        fill_stem, even_stem = (s90.kernel_key(c, p1).file_stem() for c in (fill, even))
        assert "split" not in fill_stem and even_stem == fill_stem + "_spliteven"
        assert s90.kernel_from_key(s90.kernel_key(even, p1)) == (
            dataclasses.replace(even, stages=s90.resolve_stages(even)), p1)
    for bad in (s90.swapped_config(p1, 8), s90.Sm90GemmConfig(), s90.Sm90GemmConfig(tile_n=128, padding_rows=s90.PaddingRows.SKIP)):
        ok, why = s90.can_implement(dataclasses.replace(bad, expert_split=EVEN), p1)
        assert not ok and why.startswith("expert_split") and "WEIGHTS_AS_M" in why, why
    ok, why = s90.can_implement(dataclasses.replace(s90.wide_config(p1, tile_m=288), expert_split="even"), p1)
    assert not ok and why.startswith("expert_split: expected an ExpertSplit"), why

WIDE = [  # (name, config, problem): wide swapped-operand tiles, every epilogue
    ("wide256_swiglu_dynamic", s90.wide_config(s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU)),
     s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU)),
    ("wide128_oai_bias_step16_static",
     s90.Sm90GemmConfig(tile_m=128, tile_n=128, tile_k=64, operands=s90.Operands.WEIGHTS_AS_M, token_step=16),
     s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU_OAI, True)),
    ("wide256_rowscale_bias_n64", s90.wide_config(s90.Sm90Problem(G2, 192, 128, 4, torch.bfloat16, None, True, True)),
     s90.Sm90Problem(G2, 192, 128, 4, torch.bfloat16, None, True, True)),
    ("wide128_n256_swiglu", s90.wide_config(s90.Sm90Problem(G1, 512, 128, 4, torch.bfloat16, Activation.SWIGLU),
                                            tile_m=128, max_tile_n=256),
     s90.Sm90Problem(G1, 512, 128, 4, torch.bfloat16, Activation.SWIGLU)),
    ("wide128_n256_rowscale_dynamic", s90.wide_config(s90.Sm90Problem(G2, 256, 128, 4, torch.bfloat16, None, False, True),
                                                      tile_m=128, max_tile_n=256, scheduler=s90.Scheduler.DYNAMIC),
     s90.Sm90Problem(G2, 256, 128, 4, torch.bfloat16, None, False, True)),
    # 160-row token tiles: 32-row boxes, 160 accumulator registers per thread with 256 weight rows
    ("wide160_n256_swiglu", s90.wide_config(s90.Sm90Problem(G1, 512, 128, 4, torch.bfloat16, Activation.SWIGLU),
                                            tile_m=160, max_tile_n=256),
     s90.Sm90Problem(G1, 512, 128, 4, torch.bfloat16, Activation.SWIGLU)),
    ("wide160_n256_rowscale_bias", s90.wide_config(s90.Sm90Problem(G2, 256, 128, 4, torch.bfloat16, None, True, True),
                                                   tile_m=160, max_tile_n=256),
     s90.Sm90Problem(G2, 256, 128, 4, torch.bfloat16, None, True, True)),
    ("wide160_n128_gelu_dynamic", s90.wide_config(s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.GELU_GATED),
                                                  tile_m=160, scheduler=s90.Scheduler.DYNAMIC),
     s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.GELU_GATED)),
    # 288-row token tiles: two wgmma (144 + the rest) above 144 rows, a partial last n-block (N = 320 on 128 rows)
    ("wide288_rowscale_bias_n320", s90.wide_config(s90.Sm90Problem(G2, 320, 128, 4, torch.bfloat16, None, True, True),
                                                   tile_m=288, tile_n=128),
     s90.Sm90Problem(G2, 320, 128, 4, torch.bfloat16, None, True, True)),
    ("wide288_gelu_step16_dynamic", s90.wide_config(
        s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.GELU_GATED), tile_m=288, tile_n=128, token_step=16,
        scheduler=s90.Scheduler.DYNAMIC), s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.GELU_GATED)),
    ("wide288_oai_bias", s90.wide_config(s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU_OAI, True),
                                         tile_m=288, tile_n=128),
     s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU_OAI, True)),
    # ExpertSplit.EVEN: each tile of an expert takes an even share of its rows (the same wgmma sizes and loads)
    ("wide288_even_rowscale_bias_n320", s90.wide_config(
        s90.Sm90Problem(G2, 320, 128, 4, torch.bfloat16, None, True, True), tile_m=288, tile_n=128,
        expert_split=s90.ExpertSplit.EVEN), s90.Sm90Problem(G2, 320, 128, 4, torch.bfloat16, None, True, True)),
    ("wide160_even_n256_swiglu_dynamic", s90.wide_config(
        s90.Sm90Problem(G1, 512, 128, 4, torch.bfloat16, Activation.SWIGLU), tile_m=160, max_tile_n=256,
        scheduler=s90.Scheduler.DYNAMIC, expert_split=s90.ExpertSplit.EVEN),
     s90.Sm90Problem(G1, 512, 128, 4, torch.bfloat16, Activation.SWIGLU)),
]
# ptxas spills a few registers of the gated SwiGLU epilogues of the 288-row tile (144 accumulator registers beside
# the activation's: 4-20 bytes after the last wgmma, measured); every other wide tile spills nothing
WIDE_EPILOGUE_SPILL_BYTES = {"wide288_oai_bias": 24}


@NEEDS_DSL
@pytest.mark.parametrize("name,config,problem", WIDE, ids=[s[0] for s in WIDE])
def test_compile_wide_and_check_ptx(name, config, problem, tmp_path):
    """One wgmma N per token_step multiple up to tile_m (the per-unit choice), 64-row token boxes and the
    weight tile by TMA, the stage's transaction bytes set per unit (mbarrier.arrive.expect_tx with a register
    count), an SMEM-staged epilogue; ptxas keeps the wgmma pipelined in every branch and spills nothing."""
    assert config.wide
    ptx = s90.compile_kernel(config, problem, keep_ptx=True).__ptx__
    _check_wide_ptx(ptx, config)
    if _ptxas() is not None:
        report = _ptxas_report(ptx, tmp_path)
        # C7511: serialized for want of registers (it did with one wgmma across a 288-row tile's two halves)
        assert "C7520" not in report and "C7519" not in report and "C7511" not in report, report
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", report)]
        assert spills and max(spills) <= WIDE_EPILOGUE_SPILL_BYTES.get(name, 0), report
    if config.expert_split is s90.ExpertSplit.EVEN:
        # the even share is a runtime division per unit decode (producer and consumers), which FILL does not have
        fill = s90.compile_kernel(dataclasses.replace(config, expert_split=s90.ExpertSplit.FILL), problem,
                                  keep_ptx=True).__ptx__
        divisions = [len(re.findall(r"\bdiv\.(?:s|u)32\b", text)) for text in (fill, ptx)]
        assert divisions[1] > divisions[0], divisions


def _check_wide_ptx(ptx: str, config):
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    step = config.token_step or config.tile_m
    # one wgmma N per size; a tile above 256 rows multiplies a size above its half as half + the rest
    half = config.tile_m // 2 if config.tile_m > s90.WGMMA_MAX_N else config.tile_m
    sizes = {n if n <= half else m for n in range(step, config.tile_m + 1, step) for m in (half, n - half)}
    assert shapes == {f"m64n{n}k16" for n in sizes if n > 0}
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx and "cp.async.bulk.tensor.3d.shared::cta.global" in ptx
    assert re.search(r"mbarrier\.arrive\.expect_tx\.shared(::cta)?\.b64\s+\S+, \[%r\d+\], %r\d+;", ptx)
    assert "multicast::cluster" not in ptx
    # epilogue: stmatrix.trans into the SMEM staging tile, 16-byte row stores to global memory
    assert "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx and "st.global.v4.b32" in ptx
    assert ("atom.global" in ptx or "red.global" in ptx) == (config.scheduler is s90.Scheduler.DYNAMIC)


def test_pingpong_limits():
    """PINGPONG (validated on the H200) is accepted up to a 128x128 tile per warpgroup."""
    p1 = s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU)
    assert s90.can_implement(s90.Sm90GemmConfig(tile_n=128, consumers=s90.Consumers.PINGPONG), p1) == (True, "")
    ok, why = s90.can_implement(s90.Sm90GemmConfig(tile_n=256, consumers=s90.Consumers.PINGPONG), p1)
    assert not ok and "registers" in why


@NEEDS_DSL
def test_compile_pingpong_pair():
    p1 = s90.Sm90Problem(G1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU)
    config = s90.Sm90GemmConfig(tile_n=128, consumers=s90.Consumers.PINGPONG, work_unit=WorkUnit.PAIR)
    compiled = s90.compile_kernel(config, p1, keep_ptx=True)
    _check_ptx(compiled.__ptx__, multicast=True, dynamic=False)


@NEEDS_DSL
def test_export_writes_library_ptx_and_manifest(tmp_path):
    name, config, problem = SMALL[0]
    compiled = s90.compile_kernel(config, problem, keep_ptx=True)
    key = s90.kernel_key(config, problem)
    path = rt.export_kernel(compiled, key, tmp_path, keep_ptx=True, smem_bytes=123)
    assert path.exists() and path.suffix == ".so"
    assert (tmp_path / f"{key.file_stem()}.ptx").read_text().count("wgmma.mma_async") > 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    entry = manifest[key.file_stem()]
    assert entry["key"]["n"] == problem.n and entry["smem_bytes"] == 123
    assert entry["function"] == key.function_name()
    assert entry["kernel_sources"] == rt.kernel_sources_digest(key.family) and len(entry["kernel_sources"]) == 64
    assert entry["moe2cta_version"] and entry["cutlass_dsl_version"] not in (None, "", "unknown")
    assert rt.provenance_problem(key, tmp_path) is None  # what load_kernel checks before it opens the library


def _write_entries(directory: str, prefix: str, count: int) -> None:
    for i in range(count):
        rt._write_manifest_entry(pathlib.Path(directory), f"{prefix}-{i}", {"i": i})


def test_manifest_keeps_every_entry_of_concurrent_builds(tmp_path):
    """Several build processes exporting into one bundle (e.g. one per preset) must not lose entries."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_entries, args=(str(tmp_path), f"p{j}", 40)) for j in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    manifest = rt.read_manifest(tmp_path)
    assert set(manifest) == {f"p{j}-{i}" for j in range(4) for i in range(40)}
