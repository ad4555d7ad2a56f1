"""Token GEMVs (grouped_gemm/triton_token_gemv.py) against an fp64 torch loop over (token, slot).

CPU tier: both kernels under TRITON_INTERPRET=1 on small fp16 / fp32 shapes (both w13 layouts, every
activation, biases, router weight on input or output, expert maps with unmapped experts and unused slots,
K and N tails), the default config, argument errors, and the kernel compiled for sm_90 (no spills,
griddepcontrol, vector loads). GPU tier (marker gpu): bf16 on model-like shapes, bit-stable repeats, and the
layer's token path against its grouped path and the reference inside a replayed CUDA graph.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moe2cta.grouped_gemm import Activation, GemmStage, apply_activation
from moe2cta.grouped_gemm.epilogue import W13Layout, pack_gate_up_rows
from moe2cta.grouped_gemm import triton_token_gemv as tk

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def reference(hidden, ids, w13, w2, activation, b13=None, b2=None, weights=None, on_input=False, expert_map=None,
              dtype=torch.float64):
    """(a2 [T*k, I], out [T, H], valid slots [T*k]) by a loop over slots, in `dtype` (a2 rounded to hidden's
    dtype before GEMV2, as the kernels store it)."""
    num_tokens, top_k = ids.shape
    inter = w13.shape[1] // 2
    device = hidden.device
    a2 = torch.zeros(num_tokens * top_k, inter, dtype=dtype, device=device)
    out = torch.zeros(num_tokens, w2.shape[1], dtype=dtype, device=device)
    valid = torch.zeros(num_tokens * top_k, dtype=torch.bool, device=device)
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e]) if e >= 0 else -1
            if e < 0:
                continue
            s = t * top_k + j
            valid[s] = True
            h = w13[e].to(dtype) @ hidden[t].to(dtype)
            if on_input:
                h = h * float(weights[t, j])
            if b13 is not None:
                h = h + b13[e].to(dtype)
            a2[s] = apply_activation(h[:inter].float(), h[inter:].float(), activation).to(dtype)
            y = w2[e].to(dtype) @ a2[s].to(hidden.dtype).to(dtype)
            if b2 is not None:
                y = y + b2[e].to(dtype)
            out[t] += y * (1.0 if on_input or weights is None else float(weights[t, j]))
    return a2, out, valid


def rel_err(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_case(num_tokens, top_k, num_experts, hidden, inter, dtype, device="cpu", bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]) \
        if num_tokens else torch.zeros(0, top_k, dtype=torch.long)
    return dict(
        hidden=rnd(num_tokens, hidden), ids=ids.to(torch.int32).to(device).contiguous(),
        w13=rnd(num_experts, 2 * inter, hidden, scale=hidden ** -0.5), w2=rnd(num_experts, hidden, inter, scale=inter ** -0.5),
        b13=rnd(num_experts, 2 * inter, scale=0.3) if bias else None, b2=rnd(num_experts, hidden, scale=0.3) if bias else None,
        weights=torch.rand(num_tokens, top_k, generator=gen).to(device),
    )


def run_both(c, activation, layout, on_input=False, expert_map=None, config1=None, config2=None):
    w13 = pack_gate_up_rows(c["w13"]) if layout is W13Layout.CHUNKED else c["w13"]
    a2 = tk.token_gemv1(c["hidden"], c["ids"], w13, activation, b13=c["b13"],
                        topk_weights=c["weights"] if on_input else None, expert_map=expert_map, w13_layout=layout,
                        config=config1)
    out = tk.token_gemv2_combine(a2, c["ids"], c["w2"], None if on_input else c["weights"], b2=c["b2"],
                                 expert_map=expert_map, config=config2)
    return a2, out


def check(c, a2, out, activation, on_input=False, expert_map=None, floor=1e-5):
    """Within 2x the error of a same-dtype torch run (plus `floor`) against fp64, on the tensors' device."""
    args = (c["hidden"], c["ids"], c["w13"], c["w2"], activation)
    kw = dict(b13=c["b13"], b2=c["b2"], weights=c["weights"], on_input=on_input, expert_map=expert_map)
    ref_a2, ref_out, valid = reference(*args, **kw)
    same_a2, same_out, _ = reference(*args, **kw, dtype=c["hidden"].dtype)
    assert torch.isfinite(out).all() and torch.isfinite(a2[valid]).all()
    assert rel_err(a2[valid], ref_a2[valid]) <= 2 * rel_err(same_a2[valid], ref_a2[valid]) + floor
    assert rel_err(out, ref_out) <= 2 * rel_err(same_out, ref_out) + floor


# ---------------------------------------------------------------------------------------------- CPU tier
SMALL1 = tk.TokenGemvConfig(block_j=2, block_n=8, block_k=32)  # 2 slots per program, K tail (H = 80)
SMALL2 = tk.TokenGemvConfig(block_j=4, block_n=16, block_k=32)  # N tail (H = 80), K tail (I = 48)


@pytest.mark.parametrize("dtype,layout,activation,on_input", [
    (torch.float32, W13Layout.GATE_THEN_UP, Activation.SWIGLU, False),
    (torch.float32, W13Layout.CHUNKED, Activation.SWIGLU_OAI, True),
    (torch.float16, W13Layout.CHUNKED, Activation.GELU_GATED, False),
    (torch.float16, W13Layout.GATE_THEN_UP, Activation.SWIGLU_OAI, False),
])
def test_token_gemvs_cpu(interpret, dtype, layout, activation, on_input):
    c = make_case(3, 3, 6, 80, 48, dtype, bias=True, seed=1)
    a2, out = run_both(c, activation, layout, on_input, config1=SMALL1, config2=SMALL2)
    check(c, a2, out, activation, on_input, floor=1e-5 if dtype == torch.float32 else 5e-4)


def test_expert_map_unused_slots_and_default_config_cpu(interpret):
    """Global ids through a map (-1 entries: experts on another rank) and ids of -1 (unused slots) add
    nothing; the default config (k = 3: block_j 4 masks a slot) and no bias."""
    c = make_case(4, 3, 8, 64, 32, torch.float32, seed=2)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5], dtype=torch.int32)
    c["w13"], c["w2"] = c["w13"][:6].contiguous(), c["w2"][:6].contiguous()
    c["ids"][1, 2] = -1
    a2, out = run_both(c, Activation.SWIGLU, W13Layout.CHUNKED, expert_map=expert_map)
    check(c, a2, out, Activation.SWIGLU, expert_map=expert_map)
    c["ids"][:] = 1  # every slot on an unmapped expert: zeros
    a2, out = run_both(c, Activation.SWIGLU, W13Layout.CHUNKED, expert_map=expert_map)
    assert torch.equal(out, torch.zeros_like(out))


def test_ids_outside_the_experts_add_nothing_cpu(interpret):
    """Ids past the experts (no map), past the map's end, or mapped past the local experts are off-rank, as the
    dispatch treats them (id_check=skip hands such ids to the kernels): they add nothing and address nothing."""
    c = make_case(3, 2, 4, 32, 16, torch.float32, seed=4)
    kept = c["ids"].clone()
    c["ids"][0, 1] = 4  # == E
    c["ids"][2, 0] = 1000
    a2, out = run_both(c, Activation.SWIGLU, W13Layout.GATE_THEN_UP)
    valid_ids = torch.where((c["ids"] >= 0) & (c["ids"] < 4), c["ids"], torch.full_like(c["ids"], -1))
    check(dict(c, ids=valid_ids), a2, out, Activation.SWIGLU)
    expert_map = torch.tensor([0, 1, 2, 3, 7, -1], dtype=torch.int32)  # global 4 maps past the 4 local experts
    c["ids"] = kept.clone()
    c["ids"][0, 1], c["ids"][1, 0], c["ids"][2, 1] = 4, 6, 1000  # mapped too far, past the map (twice)
    a2, out = run_both(c, Activation.SWIGLU, W13Layout.CHUNKED, expert_map=expert_map)
    valid_ids = torch.where(c["ids"] < 4, c["ids"], torch.full_like(c["ids"], -1))
    check(dict(c, ids=valid_ids), a2, out, Activation.SWIGLU)
    # an int64 map value past int32 stays off-rank, as the dispatch reads it (it was narrowed first: 2**32 -> expert 0)
    expert_map = torch.tensor([2**32, 1, 2, 3, -1, -1], dtype=torch.int64)
    c["ids"] = kept.clone()
    a2, out = run_both(c, Activation.SWIGLU, W13Layout.CHUNKED, expert_map=expert_map)
    valid_ids = torch.where(c["ids"] == 0, torch.full_like(c["ids"], -1), c["ids"])
    check(dict(c, ids=valid_ids), a2, out, Activation.SWIGLU)


def test_int64_ids_and_any_float_weights_read_as_given_cpu(interpret):
    """int64 ids (values past int32 included) and bf16 / fp16 / fp64 router weights go to the kernels as they are:
    the outputs equal those of the int32 ids and the weights widened to fp32 first (the conversions the layer used to
    launch), bit for bit; an int64 id past int32 is off-rank (it wrapped onto expert 1 when narrowed: 2**32 + 1)."""
    c = make_case(3, 2, 4, 32, 16, torch.float32, seed=6)
    for on_input in (False, True):
        for wdtype in (torch.bfloat16, torch.float16, torch.float64):
            weights = c["weights"].to(wdtype)
            want = run_both(dict(c, weights=weights.float()), Activation.SWIGLU, W13Layout.CHUNKED, on_input=on_input)
            got = run_both(dict(c, ids=c["ids"].long(), weights=weights), Activation.SWIGLU, W13Layout.CHUNKED,
                           on_input=on_input)
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (on_input, wdtype)
    ids = c["ids"].long()
    ids[1, 0] = 2**32 + 1
    a2, out = run_both(dict(c, ids=ids), Activation.SWIGLU, W13Layout.GATE_THEN_UP)
    valid_ids = c["ids"].clone()
    valid_ids[1, 0] = -1
    check(dict(c, ids=valid_ids), a2, out, Activation.SWIGLU)
    expert_map = torch.tensor([0, 1, 2, 3, -1, -1], dtype=torch.int64)  # int64 ids through an int64 map
    ids[1, 0] = 2**33  # past the map
    a2, out = run_both(dict(c, ids=ids), Activation.SWIGLU, W13Layout.CHUNKED, expert_map=expert_map)
    check(dict(c, ids=valid_ids), a2, out, Activation.SWIGLU)
    with pytest.raises(ValueError, match="topk_weights"):
        run_both(dict(c, weights=c["weights"].to(torch.int32)), Activation.SWIGLU, W13Layout.CHUNKED)


def test_empty_batch_and_bit_stable_cpu(interpret):
    c = make_case(0, 2, 4, 32, 16, torch.float32)
    a2, out = run_both(c, Activation.SWIGLU, W13Layout.GATE_THEN_UP)
    assert a2.shape == (0, 16) and out.shape == (0, 32)
    c = make_case(2, 2, 4, 32, 16, torch.float32, seed=3)
    first = run_both(c, Activation.SWIGLU, W13Layout.GATE_THEN_UP)[1]
    assert torch.equal(first, run_both(c, Activation.SWIGLU, W13Layout.GATE_THEN_UP)[1])


def test_gemv2_tile_follows_the_wave_tail():
    """GEMV2 takes the narrow tile (half the K step on half the warps) where its grid has the smaller partial last
    wave, or the same one on a grid of more than one wave; the default tile where the narrow one's tail is longer or
    one wave holds every program (132 SMs, 32 resident warps: 528 slots of 8 warps, 1056 of 4)."""
    assert tk._wave_tail(528, 528) == 1.0 and tk._wave_tail(100, 528) == 1.0  # one wave
    assert tk._wave_tail(720, 528) == pytest.approx(2 / (720 / 528))
    want = {  # (H, k, T) -> narrow?  (gpt-oss / qwen3-235b / qwen3-30b / deepseek-v3 GEMV2 grids)
        (2880, 4, 1): True,  # 720 programs: 1.36 waves of 8-warp programs, 0.68 of 4-warp ones
        (2880, 4, 2): False,  # 2.73 against 1.36 waves: a longer tail
        (4096, 8, 1): True,  # 1.94 against 0.97
        (2048, 8, 1): False,  # 0.97 against 0.48: one wave either way
        (2048, 8, 2): True,
        (2048, 8, 3): False,  # 2.91 against 1.45
        (2048, 8, 4): True,  # 3.88 against 1.94: the same tail, more than one wave
        (7168, 8, 1): True,  # 3.39 against 1.70: the same tail
        (7168, 8, 2): False,  # 6.79 against 3.39
        (7168, 8, 3): False,
    }
    for (hidden, top_k, tokens), narrow in want.items():
        problem = tk.TokenGemvProblem(GemmStage.GEMM2, tokens, top_k, hidden, 1536, torch.bfloat16, 132)
        config = tk.default_config(problem)
        assert (config.num_warps, config.block_k) == ((4, 128) if narrow else (8, 256)), (hidden, top_k, tokens)
        assert config.block_n == 4 and tk.can_implement(config, problem)[0]


def test_default_config_and_can_implement():
    p1 = tk.TokenGemvProblem(GemmStage.GEMM1, 1, 8, 768, 2048, torch.bfloat16, 132, W13Layout.CHUNKED)
    c1 = tk.default_config(p1)
    assert c1.block_j == 1 and c1.block_n % 8 == 0 and tk.can_implement(c1, p1)[0]
    assert 8 * -(-768 // c1.block_n) >= 132  # >= 1 program per SM
    assert c1.block_n == 8  # the packed layout's chunk (measured: results/token-gemv-h200-2026-12-01)
    public = tk.TokenGemvProblem(GemmStage.GEMM1, 1, 8, 768, 2048, torch.bfloat16, 132)
    assert tk.default_config(public).block_n == 16  # a gate and an up tile of 16 rows each
    tiny = tk.TokenGemvProblem(GemmStage.GEMM1, 1, 1, 512, 2048, torch.bfloat16, 132)  # 32 programs of 16: narrower
    assert tk.default_config(tiny).block_n == 8
    p2 = tk.TokenGemvProblem(GemmStage.GEMM2, 1, 8, 2048, 768, torch.bfloat16, 132)
    c2 = tk.default_config(p2)
    assert c2.block_j == 8 and tk.can_implement(c2, p2)[0]
    p3 = tk.TokenGemvProblem(GemmStage.GEMM2, 1, 6, 4096, 1536, torch.bfloat16, 132)
    assert tk.default_config(p3).block_j == 8  # next power of two of k
    p4 = tk.TokenGemvProblem(GemmStage.GEMM2, 1, 64, 4096, 1536, torch.bfloat16, 132)
    assert tk.can_implement(tk.default_config(p4), p4)[0]  # block_k shrinks under the register limit
    assert tk.can_implement(tk.TokenGemvConfig(4, 8, 64), p2) == (False, "block_j 4 < top_k 8: GEMV2 sums all slots "
                                                                       "of a token in one program")
    assert "block_n % 8" in tk.can_implement(tk.TokenGemvConfig(1, 4, 64), p1)[1]
    assert "not a power of two" in tk.can_implement(tk.TokenGemvConfig(1, 24, 64), p1)[1]
    assert "registers" in tk.can_implement(tk.TokenGemvConfig(8, 32, 256), p2)[1]
    odd = tk.TokenGemvProblem(GemmStage.GEMM1, 1, 2, 20, 64, torch.bfloat16, 132, W13Layout.CHUNKED)
    assert "intermediate size (20) a multiple of 8" in tk.can_implement(tk.TokenGemvConfig(1, 8, 64), odd)[1]
    qwen3_30b, deepseek, mixtral = (3 * h * i * 2 for h, i in ((2048, 768), (7168, 2048), (4096, 14336)))
    qwen3_235b = 3 * 4096 * 1536 * 2
    assert [tk.token_gemv_applies(t, qwen3_30b) for t in (0, 1, 8, 9)] == [False, True, True, False]
    assert [tk.token_gemv_applies(t, qwen3_235b) for t in (4, 5)] == [True, False]
    assert [tk.token_gemv_applies(t, deepseek) for t in (1, 2, 3)] == [True, True, False]
    assert not tk.token_gemv_applies(1, mixtral)  # 352 MB experts: the grouped GEMM streams them as fast
    assert tk.TOKEN_GEMV_MAX_TOKENS == 8


def test_argument_errors():
    c = make_case(2, 2, 4, 32, 16, torch.float32)
    h, ids, w13, w2 = c["hidden"], c["ids"], c["w13"], c["w2"]
    with pytest.raises(TypeError, match="^hidden: expected a torch.Tensor"):
        tk.token_gemv1(h.numpy(), ids, w13)
    with pytest.raises(ValueError, match="^topk_ids: expected dtype"):
        tk.token_gemv1(h, ids.short(), w13)
    with pytest.raises(ValueError, match="^topk_ids: expected 2 rows"):
        tk.token_gemv1(h, ids[:1].contiguous(), w13)
    with pytest.raises(ValueError, match="^w13: expected dtype"):
        tk.token_gemv1(h, ids, w13.half())
    with pytest.raises(ValueError, match="^hidden: expected 32 columns"):
        tk.token_gemv1(h[:, :16].contiguous(), ids, w13)
    with pytest.raises(ValueError, match="^b13: expected a contiguous tensor of shape"):
        tk.token_gemv1(h, ids, w13, b13=torch.zeros(4, 16))
    with pytest.raises(ValueError, match="^topk_weights: expected dtype"):
        tk.token_gemv1(h, ids, w13, topk_weights=c["weights"].int())
    with pytest.raises(TypeError, match="^w13_layout: expected a W13Layout"):
        tk.token_gemv1(h, ids, w13, w13_layout="chunked")
    with pytest.raises(ValueError, match="^activation: expected one of"):
        tk.token_gemv1(h, ids, w13, activation="relu")
    with pytest.raises(TypeError, match="^config: expected a TokenGemvConfig"):
        tk.token_gemv1(h, ids, w13, config=(1, 8, 32))
    with pytest.raises(ValueError, match="^config: block_j 1 < top_k 2"):
        tk.token_gemv2_combine(torch.zeros(4, 16), ids, w2, config=tk.TokenGemvConfig(1, 8, 32))
    with pytest.raises(ValueError, match="^a2: expected T \\* k = 4 rows"):
        tk.token_gemv2_combine(torch.zeros(3, 16), ids, w2)
    with pytest.raises(TypeError, match="^out_dtype: expected one of"):
        tk.token_gemv2_combine(torch.zeros(4, 16), ids, w2, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="^expert_map: expected dtype"):
        tk.token_gemv2_combine(torch.zeros(4, 16), ids, w2, expert_map=torch.zeros(4))
    with pytest.raises(ValueError, match="^out: expected torch.float32 \\[2, 32\\]"):
        tk.token_gemv2_combine(torch.zeros(4, 16), ids, w2, out=torch.zeros(2, 16))
    # out shares no memory with what the programs read, nor its rows with each other (programs store while others read)
    with pytest.raises(ValueError, match="^out: expected memory of its own, got one that overlaps hidden"):
        tk.token_gemv1(h, ids, w13, out=h.reshape(-1)[:64].view(4, 16))
    a2 = torch.zeros(4, 32)
    with pytest.raises(ValueError, match="^out: expected memory of its own, got one that overlaps a2"):
        tk.token_gemv2_combine(a2.view(4, 2, 16)[:, 0], ids, w2, out=a2[:2])
    with pytest.raises(ValueError, match="^out: expected rows of their own memory"):
        tk.token_gemv1(h, ids, w13, out=torch.zeros(1, 16).expand(4, 16))
    with pytest.raises(ValueError, match="^w13_layout chunked needs the intermediate size \\(12\\) a multiple of 8"):
        tk.token_gemv1(torch.zeros(2, 32), ids, torch.zeros(4, 24, 32), w13_layout=W13Layout.CHUNKED)


_COMPILE_SCRIPT = """
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from moe2cta.grouped_gemm import triton_token_gemv as tk

consts, num_warps = json.loads(sys.argv[1])
fn = tk._kernel()
names = fn.arg_names
sig = {}
for n in names:
    if n in consts:
        sig[n] = "constexpr"
    elif n in ("ids_ptr", "map_ptr"):
        sig[n] = "*i32"
    elif n == "topk_w_ptr":
        sig[n] = "*fp32"
    elif n.endswith("_ptr"):
        sig[n] = "*bf16"
    else:
        sig[n] = "i32"
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t != "constexpr" and n != "num_tokens"}
src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1,
                                                                    "launch_pdl": True})
ptx = k.asm["ptx"]
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "k.ptx")
    open(path, "w").write(ptx)
    info = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", path, "-o", path + ".o"],
                          capture_output=True, text=True).stderr
print(json.dumps({"spills": sum(int(x) for x in re.findall(r"(\\d+) bytes spill", info)),
                  "registers": max(int(x) for x in re.findall(r"Used (\\d+) registers", info)),
                  "vector_loads": ptx.count("ld.global.v4"), "gdc_wait": "griddepcontrol.wait" in ptx,
                  "gdc_launch": "griddepcontrol.launch_dependents" in ptx, "atomics": "atom." in ptx}))
"""


def _compile_facts(consts: dict, num_warps: int) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps([consts, num_warps])], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("top_k", [8, 4])
def test_gemv2_narrow_tile_needs_no_more_registers(top_k):
    """default_config's wave model counts twice the narrow GEMV2 tile's programs per SM (half the warps): that
    holds while the narrow tile needs at most the default's registers per thread (sm_90a, Triton's ptxas)."""
    pytest.importorskip("triton.backends.nvidia")
    facts = {}
    for (_, block_k, num_warps) in (tk._GEMV2_TILE, tk._GEMV2_NARROW_TILE):
        consts = dict(TOP_K=top_k, STAGE=2, ACTIVATION=0, HAS_MAP=False, HAS_WEIGHTS=True, HAS_BIAS=top_k == 4,
                      W13_CHUNK=0, EVEN_K=True, DEPENDENT_LAUNCH=True, BLOCK_J=top_k, BLOCK_N=4, BLOCK_K=block_k)
        facts[num_warps] = _compile_facts(consts, num_warps)
    assert facts[4]["spills"] == 0 and facts[8]["spills"] == 0
    assert facts[4]["registers"] <= facts[8]["registers"]


@pytest.mark.parametrize("stage,chunk,block_j,block_n,block_k", [(1, 8, 1, 8, 512), (1, 0, 1, 16, 256),
                                                                  (2, 0, 8, 4, 256)])
def test_compiles_for_sm90(stage, chunk, block_j, block_n, block_k):
    """Compiled (not interpreted) for sm_90a with Triton's ptxas: no spills, 16-byte weight loads,
    griddepcontrol wait + early release, no atomics (the combine is in-program)."""
    pytest.importorskip("triton.backends.nvidia")
    consts = dict(TOP_K=8, STAGE=stage, ACTIVATION=2, HAS_MAP=True, HAS_WEIGHTS=True, HAS_BIAS=True,
                  W13_CHUNK=chunk, EVEN_K=True, DEPENDENT_LAUNCH=True, BLOCK_J=block_j, BLOCK_N=block_n,
                  BLOCK_K=block_k)
    facts = _compile_facts(consts, 4)
    assert facts["spills"] == 0 and facts["registers"] <= 168
    assert facts["vector_loads"] > 0 and facts["gdc_wait"] and facts["gdc_launch"] and not facts["atomics"]


# ---------------------------------------------------------------------------------------------- GPU tier
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

SHAPES = {  # (H, I, E, k, activation, bias): the presets' layer shapes, smaller E where it changes nothing
    "qwen3-30b": (2048, 768, 128, 8, Activation.SWIGLU, False),
    "gpt-oss": (2880, 2880, 32, 4, Activation.SWIGLU_OAI, True),
    "mixtral": (4096, 14336, 8, 2, Activation.SWIGLU, False),
    "dsv3-like": (7168, 2048, 16, 8, Activation.GELU_GATED, False),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_token_gemvs_gpu(shape, num_tokens):
    hidden, inter, experts, top_k, activation, bias = SHAPES[shape]
    c = make_case(num_tokens, top_k, experts, hidden, inter, torch.bfloat16, device="cuda", bias=bias, seed=5)
    for layout in (W13Layout.CHUNKED, W13Layout.GATE_THEN_UP):
        a2, out = run_both(c, activation, layout)
        check(c, a2, out, activation, floor=2e-3)
        assert torch.equal(out, run_both(c, activation, layout)[1])  # bit-stable


@pytest.mark.gpu
@needs_cuda
def test_layer_token_path_in_a_replayed_graph_gpu():
    """MoELayer TRITON at 1..4 tokens: the token path (no dispatch) matches the grouped path's accuracy, has
    no host sync, and a captured graph replays with a new routing."""
    from moe2cta import MoELayer, RoutingConfig, moe_reference, route

    gen = torch.Generator(device="cuda").manual_seed(7)
    hidden_size, inter, experts = 1024, 512, 32
    w13 = torch.randn(experts, 2 * inter, hidden_size, device="cuda", generator=gen).div(hidden_size ** 0.5).bfloat16()
    w2 = torch.randn(experts, hidden_size, inter, device="cuda", generator=gen).div(inter ** 0.5).bfloat16()
    routing = RoutingConfig(top_k=4)
    token = MoELayer(w13, w2, routing=routing, backend="triton", token_gemv_max_tokens=4)
    grouped = MoELayer(w13, w2, routing=routing, backend="triton", token_gemv_max_tokens=0)
    for num_tokens in (1, 2, 4):
        h = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen).bfloat16()
        logits = torch.randn(num_tokens, experts, device="cuda", generator=gen)
        weights, ids = route(logits, routing, backend="torch")
        want = moe_reference(h, w13, w2, weights, ids, dtype=torch.float64)
        same = moe_reference(h, w13, w2, weights, ids, dtype=torch.bfloat16)
        bound = 2 * rel_err(same, want) + 1e-3
        assert rel_err(token(h, logits), want) <= bound and rel_err(grouped(h, logits), want) <= bound
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            token(h, logits)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = token(h, logits)
        new_logits = torch.randn(logits.shape, device="cuda", generator=gen)
        logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        weights, ids = route(new_logits, routing, backend="torch")
        want = moe_reference(h, w13, w2, weights, ids, dtype=torch.float64)
        assert rel_err(static_out, want) <= bound


@pytest.mark.parametrize("layout", list(W13Layout))
def test_swiglu_oai_clamp_and_nan_cpu(interpret, layout):
    """gpt-oss's clamp (gate <= 7, |up| <= 7) where most gate / up values are past it (biases of scale 12), and a NaN
    in a token row giving NaN in that token's slots and output for every activation (as the twin and torch.clamp do;
    Triton's default minimum / maximum would return the other operand)."""
    c = make_case(3, 2, 5, 64, 32, torch.float32, bias=True, seed=4)
    c["b13"] = c["b13"] * 40.0  # scale 0.3 -> 12
    gate_up = torch.einsum("th,eih->tei", c["hidden"].double(), c["w13"].double()) + c["b13"].double()[None]
    assert (gate_up.abs() > 7).double().mean() > 0.5  # the clamp is exercised
    a2, out = run_both(c, Activation.SWIGLU_OAI, layout, config1=SMALL1, config2=SMALL2)
    check(c, a2, out, Activation.SWIGLU_OAI)
    c["hidden"][1, 5] = float("nan")
    for activation in Activation:
        a2, out = run_both(c, activation, layout, config1=SMALL1, config2=SMALL2)
        token = torch.arange(a2.shape[0]) // 2
        assert torch.isnan(a2[token == 1]).all() and torch.isfinite(a2[token != 1]).all(), activation
        assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all(), activation


def test_empty_expert_map_and_untyped_inputs_are_refused(interpret):
    c = make_case(2, 2, 4, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="^expert_map: expected at least one entry"):
        tk.token_gemv1(c["hidden"], c["ids"], c["w13"], expert_map=torch.empty(0, dtype=torch.int32))
    with pytest.raises(TypeError, match="^a2: expected a torch.Tensor"):
        tk.token_gemv2_combine(None, c["ids"], c["w2"], c["weights"])
    with pytest.raises(ValueError, match="^config: num_warps: expected an int"):
        tk.token_gemv1(c["hidden"], c["ids"], c["w13"], config=tk.TokenGemvConfig(2, 8, 32, num_warps=4.0))
