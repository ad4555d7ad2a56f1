"""Stop 40: stop 39's bisection of the wide tile's token-row hang confounded gpt-oss-120b's K (45 K tiles on 4
stages) with its epilogue (SWIGLU_OAI with a bias) and its batch. This probe varies one at a time. One case per
process (the caller's timeout is the watchdog): the wide tile on the token rows against the same tile on the gathered
copy, bit-equal expected on the valid rows, random routing.

    python probe_tr2.py build OUT_DIR          (here, CUTE_DSL_ARCH=sm_90a: can_implement refuses most cases)
    python probe_tr2.py CASE KERNEL_DIR        (there)
"""
import dataclasses
import sys
import time

import torch

from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
from moe2cta.grouped_gemm.epilogue import Activation, GemmStage

# name: (tile_m, tile_n, N, K, activation, bias, tokens, top_k, scheduler)
CASES = {
    "t288_k2880_oai_static": (288, 128, 5760, 2880, Activation.SWIGLU_OAI, True, 8192, 4, "static"),  # stop 39's hang
    "t288_k2880_plain_static": (288, 128, 5760, 2880, Activation.SWIGLU, False, 8192, 4, "static"),
    "t288_k2048_oai_static": (288, 128, 1536, 2048, Activation.SWIGLU_OAI, True, 4096, 8, "static"),
    "t160_k2880_plain_static": (160, 256, 1536, 2880, Activation.SWIGLU, False, 2048, 8, "static"),
    "t160_k2048_oai_static": (160, 256, 1536, 2048, Activation.SWIGLU_OAI, True, 2048, 8, "static"),
}


def configs(case):
    tile_m, tile_n, n, k, act, has_bias, tokens, top_k, sched = CASES[case]
    problem = s90.Sm90Problem(GemmStage.GEMM1, n, k, 128, torch.bfloat16, act, has_bias)
    scheduler = {"static": s90.Scheduler.STATIC, "dynamic": s90.Scheduler.DYNAMIC}[sched]
    copy = s90.Sm90GemmConfig(tile_m=tile_m, tile_n=tile_n, tile_k=s90.WIDE_TILE_K, scheduler=scheduler,
                              raster=s90.Raster.ALONG_N, operands=s90.Operands.WEIGHTS_AS_M,
                              token_step=s90.WIDE_TOKEN_STEP, expert_split=s90.ExpertSplit.EVEN)
    return problem, copy, dataclasses.replace(copy, a_source=s90.ASource.TOKEN_ROWS)


if sys.argv[1] == "build":
    real = s90.can_implement
    for case in CASES:
        problem, copy, tr = configs(case)
        assert real(copy, problem)[0], (case, real(copy, problem))
        s90._export(copy, problem, sys.argv[2], False)
        s90.can_implement = lambda c, p: (True, "")  # the token-row build is the probe's subject
        try:
            s90._export(tr, problem, sys.argv[2], False)
        finally:
            s90.can_implement = real
        print(case, "built", "(can_implement:", real(tr, problem)[1] or "takes it", ")", flush=True)
    sys.exit(0)

from moe2cta.serving_bench.hopper_gemm_bench import make_counts, padded_layout, valid_row_mask  # noqa: E402

case, kdir = sys.argv[1], sys.argv[2]
problem, copy, tr = configs(case)
_, _, n, k, _, has_bias, tokens, top_k, _ = CASES[case]
e = problem.num_experts


def launch(cfg, a, out, *token_rows):
    kernel = s90._cache_for(kdir).get(s90.kernel_key(cfg, problem), None)
    workspace, dummy_bias, dummy_scale = s90._launch_scratch(cfg, a.device)
    kbias, _ = s90.epilogue_operands(GemmStage.GEMM1, e, n, out.shape[0], bias, None)
    operands = (a, w) if not token_rows else (a, token_rows[0], w)
    tail = (int(cfg.pair_threshold),) + ((int(token_rows[1]),) if token_rows else ())
    kernel(*operands, out, ro_d, counts_d, kbias if kbias is not None else dummy_bias, dummy_scale, workspace, *tail)
    return out


gen = torch.Generator().manual_seed(1)
counts = make_counts("random", tokens, top_k, e, gen)
max_rows = int(counts.sum()) + e * 127
ro = padded_layout(counts, max_rows)
slots = int(counts.sum())
hidden = (torch.randn(tokens, k, generator=gen) * 0.5).to(torch.bfloat16).cuda()
a_rows = torch.full((max_rows,), -1, dtype=torch.int32)
a_rows[valid_row_mask(ro, counts, max_rows)] = torch.randperm(slots, generator=gen).to(torch.int32)
a_rows = a_rows.cuda()
a = hidden[torch.where(a_rows >= 0, a_rows // top_k, torch.arange(max_rows, device="cuda") % tokens).long()]
w = s90.prepack_w13((torch.randn(e, n, k, device="cuda") / k**0.5).to(torch.bfloat16))
bias = torch.randn(e, n, device="cuda") * 0.5 if has_bias else None
mask = valid_row_mask(ro, counts, max_rows).cuda()
ro_d, counts_d = ro.cuda(), counts.cuda()
out_copy = launch(copy, a, torch.empty(max_rows, n // 2, dtype=torch.bfloat16, device="cuda"))
torch.cuda.synchronize()
print(case, "copy ok", flush=True)
for attempt in range(3):
    t = time.time()
    out_tr = launch(tr, hidden, torch.empty(max_rows, n // 2, dtype=torch.bfloat16, device="cuda"), a_rows, top_k)
    torch.cuda.synchronize()
    print(case, "token rows ok", round(time.time() - t, 4), "s, bit-equal on valid rows:",
          torch.equal(out_tr[mask], out_copy[mask]), flush=True)
