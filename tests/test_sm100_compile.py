"""sm_100a grouped GEMM: config validity, resource model vs planner, and compile-only checks on CPU.

No Blackwell GPU is needed: kernels are compiled for sm_100a on fake tensors with a symbolic row count and
the PTX / host IR are inspected. The default tier compiles one kernel directly and the 4 kernels of
qwen3-30b-a3b through the bundle command; every preset's kernels (20, about 2.5 minutes on 2 cores) are
marked slow (CI runs them: it does not deselect the marker).
"""
import dataclasses
import re
import shutil
import subprocess
import sys

import pytest

from moe2cta.grouped_gemm import Activation, GemmStage
from moe2cta.grouped_gemm.budget import Arch, WorkUnit
from moe2cta.grouped_gemm.cute_runtime import dsl_available
from moe2cta.grouped_gemm import sm100_grouped_gemm as sm100
from moe2cta.grouped_gemm.sm100_grouped_gemm import Sm100GemmConfig, Sm100Problem
from moe2cta.presets import PRESETS, get_preset

needs_dsl = pytest.mark.skipif(not dsl_available(), reason="nvidia-cutlass-dsl is not installed")

PAIR_PTX = ("tcgen05.mma.cta_group::2", "tcgen05.alloc.cta_group::2", "tcgen05.ld", "clusterlaunchcontrol.try_cancel")
SINGLE_PTX = ("tcgen05.mma.cta_group::1", "tcgen05.alloc.cta_group::1", "tcgen05.ld", "clusterlaunchcontrol.try_cancel")


def _gemm1(n=1536, k=2048, e=128, activation=Activation.SWIGLU, bias=False):
    return Sm100Problem(GemmStage.GEMM1, n, k, e, activation=activation, has_bias=bias)


def _planner_budget(config, problem):
    from moe2cta.planner import Candidate, GemmKind, GemmProblem, compute_budget

    kind = GemmKind.GEMM1 if problem.stage is GemmStage.GEMM1 else GemmKind.GEMM2
    gemm = GemmProblem("x", kind, problem.n, problem.k, (256,) * problem.num_experts, "balanced")
    use = sm100.resource_use(config, problem)
    cand = Candidate(Arch.SM100, config.unit, config.tile_m, config.tile_n, config.tile_k, use.stages,
                     config.accumulator_slots, 0, config.epi_n, config.epi_buffers)
    return compute_budget(cand, gemm)


def test_import_needs_no_dsl():
    code = ("import sys, moe2cta.grouped_gemm.sm100_grouped_gemm as m; "
            "assert 'cutlass' not in sys.modules and 'tvm_ffi' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_and_problem_validation():
    with pytest.raises(TypeError, match="unit"):
        Sm100GemmConfig(unit="pair")
    with pytest.raises(ValueError, match="tile_n"):
        Sm100GemmConfig(tile_n=0)
    with pytest.raises(ValueError, match="stages"):
        Sm100GemmConfig(stages=-1)
    with pytest.raises(TypeError, match="stage"):
        Sm100Problem("gemm1", 256, 256, 4)
    with pytest.raises(ValueError, match="has_row_scale"):
        Sm100Problem(GemmStage.GEMM1, 256, 256, 4, has_row_scale=True)
    with pytest.raises(ValueError, match="activation"):
        Sm100Problem(GemmStage.GEMM2, 256, 256, 4, activation=Activation.SWIGLU)
    assert Sm100GemmConfig().tile == (256, 256, 64) and Sm100GemmConfig().cluster == (2, 1, 1)
    single = Sm100GemmConfig(unit=WorkUnit.SINGLE)
    assert single.tile_m == 128 and single.cluster == (1, 1, 1)
    assert Sm100GemmConfig(pair_threshold=129).single_fallback().unit is WorkUnit.SINGLE


@pytest.mark.parametrize(
    "config, problem, fragment",
    [
        (Sm100GemmConfig(tile_n=256), _gemm1(n=5760), "N=5760"),
        (Sm100GemmConfig(tile_k=64), _gemm1(k=2880 + 32), "K="),
        (Sm100GemmConfig(tile_n=264), _gemm1(), "tile_n"),
        (Sm100GemmConfig(unit=WorkUnit.SINGLE, pair_threshold=64), _gemm1(), "pair_threshold"),
        (Sm100GemmConfig(stages=12), _gemm1(), "SMEM"),
        (Sm100GemmConfig(accumulator_slots=3, tile_n=128), _gemm1(), "accumulator_slots"),
        (Sm100GemmConfig(tile_n=128, epi_n=48), Sm100Problem(GemmStage.GEMM2, 2048, 768, 8), "epi_n"),
    ],
)
def test_can_implement_gives_reasons(config, problem, fragment):
    ok, reason = sm100.can_implement(config, problem)
    assert not ok and fragment in reason


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_has_pair_and_single_kernels_matching_the_planner(name):
    for problem, config in sm100.preset_configs(get_preset(name)):
        assert sm100.can_implement(config, problem) == (True, "")
        use = sm100.resource_use(config, problem)
        budget = _planner_budget(config, problem)
        assert use.smem_bytes == budget.smem_bytes
        assert use.tmem_alloc_columns == budget.tmem_alloc_columns <= 512
        assert use.stages >= 2
    units = {config.unit for _, config in sm100.preset_configs(get_preset(name))}
    assert units == {WorkUnit.PAIR, WorkUnit.SINGLE}


def test_pair_halves_b_per_cta():
    problem = _gemm1()
    pair = sm100.resource_use(Sm100GemmConfig(unit=WorkUnit.PAIR, tile_n=256, stages=3), problem)
    single = sm100.resource_use(Sm100GemmConfig(unit=WorkUnit.SINGLE, tile_n=256, stages=3), problem)
    assert pair.a_stage_bytes + pair.b_stage_bytes == 32 * 1024  # the seed's 2-CTA number
    assert single.a_stage_bytes + single.b_stage_bytes == 48 * 1024
    assert pair.tmem_columns == 512  # two 256-column slots fill TMEM


def test_ptx_and_ir_parsers():
    ptx = "mov.b32 \t%r7, 384;\n\tmov.b32 \t%r9, 512;\n\ttcgen05.alloc.cta_group::2.sync.aligned.shared::cta.b32 \t[%r3], %r9;\n"
    assert sm100._ptx_tmem_alloc_columns(ptx) == 512
    assert sm100.ptx_report(ptx)["tcgen05.alloc.cta_group::2"] == 1
    struct = sm100._LAUNCH_STRUCT
    ir = (f"    %24 = llvm.mlir.constant(214016 : i64) : i64\n"
          f"    %147 = llvm.getelementptr %141[0, 2] : (!llvm.ptr) -> !llvm.ptr, !llvm.{struct}\n"
          f"    llvm.store %24, %147 : i64, !llvm.ptr\n")
    assert sm100._ir_launch_smem_bytes(ir) == 214016


def _random_layout(gen, num_experts, align):
    import torch

    counts = torch.randint(0, 700, (num_experts,), generator=gen)
    counts[torch.randperm(num_experts, generator=gen)[: num_experts // 3]] = 0  # empty experts on purpose
    padded = (counts + align - 1) // align * align
    offsets = [0] + torch.cumsum(padded, 0).tolist()
    max_rows = int(counts.sum()) + num_experts * (align - 1)
    return offsets, counts.tolist(), max_rows


@pytest.mark.parametrize("align", [128, 256])
@pytest.mark.parametrize("unit, threshold", [(WorkUnit.PAIR, 0), (WorkUnit.SINGLE, 0), (WorkUnit.PAIR, 129)])
def test_tile_plan_stores_every_valid_row_once(align, unit, threshold):
    import torch

    gen = torch.Generator().manual_seed(align + threshold + (unit is WorkUnit.PAIR))
    config = Sm100GemmConfig(unit=unit, pair_threshold=threshold)
    for _ in range(20):
        offsets, counts, max_rows = _random_layout(gen, 13, align)
        launches = [(config, 0, sm100.NO_UPPER_BOUND)]
        if threshold:
            launches = [(config, threshold, sm100.NO_UPPER_BOUND), (config.single_fallback(), 0, threshold)]
        written = {}
        for cfg, lo, hi in launches:
            for expert, row0, stores in sm100.tile_plan(offsets, counts, cfg, max_rows, lo, hi):
                assert (row0 - offsets[expert]) % cfg.tile_m == 0
                assert (counts[expert] >= threshold) == (cfg.unit is WorkUnit.PAIR) or not threshold
                for v, store in enumerate(stores):
                    if not store:
                        continue
                    first = row0 + v * sm100.ROWS_PER_CTA
                    for r in range(first, min(first + sm100.ROWS_PER_CTA, max_rows)):
                        assert offsets[expert] <= r < offsets[expert + 1]  # never another expert's rows
                        written[r] = written.get(r, 0) + 1
        valid = {r for e, c in enumerate(counts) for r in range(offsets[e], offsets[e] + c)}
        assert valid <= set(written) and all(n == 1 for n in written.values())


_COMPILED = {}


def _check_tma_ptx(ptx: str, unit: WorkUnit) -> None:
    """TMA loads of A (2-d) and of the expert's weight tile (3-d: the expert mode): a PAIR's are the 2-CTA loads
    (.cta_group::2, into either CTA of the cluster, completing the leader's barrier: the pair shares one weight
    tile, each CTA holding half), a SINGLE's plain per-CTA loads; the epilogue's TMA stores."""
    loads = set(re.findall(r"cp\.async\.bulk\.tensor\.(\dd)\.shared::(\w+)\.global[\w:.]*?(\.cta_group::2)?\s", ptx))
    want = {("2d", "cluster", ".cta_group::2"), ("3d", "cluster", ".cta_group::2")} if unit is WorkUnit.PAIR else \
        {("2d", "cta", ""), ("3d", "cta", "")}
    assert loads == want, loads
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx


def _check_compiled(config, problem):
    """Compile once per (config, problem) in this session; check PTX, SMEM and TMEM against the planner."""
    if (config, problem) not in _COMPILED:
        _COMPILED[(config, problem)] = sm100.compile_kernel(config, problem, keep_ptx=True)
    compiled, report = _COMPILED[(config, problem)]
    budget = _planner_budget(config, problem)
    expected = PAIR_PTX if config.unit is WorkUnit.PAIR else SINGLE_PTX
    for mnemonic in expected:
        assert report.instructions[mnemonic] >= 1, mnemonic
    other = "tcgen05.mma.cta_group::1" if config.unit is WorkUnit.PAIR else "tcgen05.mma.cta_group::2"
    assert report.instructions[other] == 0
    _check_tma_ptx(compiled.__ptx__, config.unit)
    assert report.smem_bytes == budget.smem_bytes == sm100.resource_use(config, problem).smem_bytes
    assert report.tmem_alloc_columns == budget.tmem_alloc_columns
    return compiled


@needs_dsl
def test_compile_gpt_oss_gemm2_bias_row_scale_pair():
    problem = sm100.preset_problems(get_preset("gpt-oss-120b"))[1]
    assert problem.has_bias and problem.has_row_scale
    config = sm100.default_config(problem, WorkUnit.PAIR)
    assert config.tile_n == 192  # 2880 columns: the widest N tile that divides
    _check_compiled(config, problem)


@needs_dsl
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_compile_every_preset(name):
    for problem, config in sm100.preset_configs(get_preset(name)):
        _check_compiled(config, problem)


@needs_dsl
@pytest.mark.slow
def test_compile_gelu_gated_with_bias():
    problem = _gemm1(n=512, k=256, e=8, activation=Activation.GELU_GATED, bias=True)
    _check_compiled(sm100.default_config(problem, WorkUnit.PAIR), problem)


@needs_dsl
@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("nm") is None, reason="needs gcc and nm to export")
def test_aot_bundle_command(tmp_path):
    out = tmp_path / "bundle"
    cmd = [sys.executable, "-m", "moe2cta.aot", "build", "--model", "qwen3-30b-a3b", "--arch", "sm_100a",
           "--out", str(out), "--keep-ptx"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    from moe2cta.grouped_gemm.cute_runtime import read_manifest

    manifest = read_manifest(out)
    assert len(manifest) == 4
    for stem, entry in manifest.items():
        info = entry["info"]
        assert info["smem_bytes_compiled"] == info["smem_bytes_model"]
        assert info["tmem_alloc_columns_compiled"] == info["tmem_alloc_columns_model"]
        ptx = (out / entry["ptx"]).read_text()
        wanted = PAIR_PTX if info["unit"] == "pair" else SINGLE_PTX
        assert all(m in ptx for m in wanted)
        symbols = subprocess.run(["nm", "-D", str(out / entry["library"])], capture_output=True, text=True).stdout
        assert entry["function"] in symbols


def test_host_api_rejects_bad_arguments_without_gpu():
    import torch

    from moe2cta.grouped_gemm.sm100_grouped_gemm import sm100_grouped_gemm1, sm100_grouped_gemm2

    a = torch.randn(256, 128, dtype=torch.bfloat16)
    w2 = torch.randn(2, 256, 128, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 128, 256], dtype=torch.int32)
    counts = torch.tensor([100, 3], dtype=torch.int32)
    with pytest.raises(TypeError, match="counts"):
        sm100_grouped_gemm2(a, w2, offsets, counts.long())
    with pytest.raises(TypeError, match="w2"):
        sm100_grouped_gemm2(a, w2.float(), offsets, counts)
    with pytest.raises(TypeError, match="row_offsets"):
        sm100_grouped_gemm2(a, w2, offsets[:2], counts)
    with pytest.raises(TypeError, match="a:"):
        sm100_grouped_gemm1(a.float(), w2, offsets, counts)
    with pytest.raises(ValueError, match="CUDA"):
        sm100_grouped_gemm2(a, w2, offsets, counts)


def test_can_implement_checks_the_single_fallback():
    """A PAIR config with a pair_threshold also launches its SINGLE twin for the smaller experts: can_implement refuses
    it where that twin cannot run (here: one 128-deep stage of 8 epilogue buffers fits in SMEM), instead of the call
    failing after its first launch."""
    config = Sm100GemmConfig(unit=WorkUnit.PAIR, tile_n=128, tile_k=128, epi_n=64, epi_buffers=8, pair_threshold=129)
    problem = Sm100Problem(GemmStage.GEMM2, 4096, 4096, 8)
    assert sm100.can_implement(dataclasses.replace(config, pair_threshold=0), problem) == (True, "")
    ok, why = sm100.can_implement(config, problem)
    assert not ok and why.startswith("pair_threshold 129: the SINGLE launch"), why
    assert sm100.can_implement("pair", problem) == (False, "expected an Sm100GemmConfig, got str")


def test_sm100_host_checks_from_the_kernel_audit():
    """What a read of the kernels against their checks found (stop 52): the wrappers take the dispatch's align (the
    kernel's tiles start on 128-row halves: a 64-row dispatch was multiplied by the wrong experts), default_config tries
    narrower epilogue sub-tiles before it gives up, and a config small enough in SMEM for two CTAs per SM but
    allocating more than half the TMEM each is refused."""
    import torch

    a = torch.zeros(256, 512, dtype=torch.bfloat16)
    w = torch.zeros(2, 256, 512, dtype=torch.bfloat16)
    ro = torch.tensor([0, 64, 128], dtype=torch.int32)
    counts = torch.tensor([64, 64], dtype=torch.int32)
    for align in (64, 96, True, 0):
        with pytest.raises(ValueError, match="^align: expected the dispatch's align, a multiple of the 128 rows"):
            sm100.sm100_grouped_gemm2(a, w, ro, counts, align=align)
    gemm1 = Sm100Problem(GemmStage.GEMM1, 480, 512, 8, "bfloat16", activation=Activation.SWIGLU)
    config = sm100.default_config(gemm1, WorkUnit.SINGLE)
    assert config.tile_n == 160 and config.epi_n == 16 and sm100.can_implement(config, gemm1) == (True, "")
    with pytest.raises(ValueError, match=r"no sm_100 tile fits N=24, K=512 \(the narrowest tried: N=24: must be"):
        sm100.default_config(Sm100Problem(GemmStage.GEMM2, 24, 512, 8, "bfloat16"))
    deepseek_gemm2 = Sm100Problem(GemmStage.GEMM2, 7168, 2048, 256, "bfloat16", has_row_scale=True)
    ok, why = sm100.can_implement(Sm100GemmConfig(tile_n=256, stages=2), deepseek_gemm2)
    assert not ok and "2 CTAs would share an SM" in why
    assert sm100.can_implement(Sm100GemmConfig(tile_n=256), deepseek_gemm2) == (True, "")
    # stop 55: three or four CTAs by SMEM, each at or under half the TMEM, are over it together
    gemm2 = Sm100Problem(GemmStage.GEMM2, 4608, 4096, 64, "bfloat16", has_row_scale=True)
    for unit, ctas in ((WorkUnit.SINGLE, 3), (WorkUnit.PAIR, 4)):
        small = Sm100GemmConfig(unit=unit, tile_n=96, stages=2, accumulator_slots=2, epi_n=16, epi_buffers=1)
        ok, why = sm100.can_implement(small, gemm2)
        assert not ok and f"{ctas} CTAs would share an SM, each allocating 256 of its 512 TMEM columns" in why, why
    # a key the family would not build (too many stages for SMEM, three accumulator slots) is not read back
    key = sm100.kernel_key(Sm100GemmConfig(tile_n=256), deepseek_gemm2)
    for name, value in (("stages", 30), ("acc", 3)):
        extra = tuple((item[0], value, *item[2:]) if item[0] == name else item for item in key.extra)
        with pytest.raises(ValueError, match=f"^key: .*: "):
            sm100.kernel_from_key(dataclasses.replace(key, extra=extra))
