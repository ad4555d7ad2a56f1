"""Stop 39, call 3: which wide token-row kernels hang. One case per process (the caller's timeout is the watchdog):
the 288-row tile on the token rows against the same tile on the gathered copy (bit-equal expected), random routing.
can_implement refuses the 288-row tile on the token rows now, so the kernels are called straight from the bundle."""
import dataclasses
import sys
import time

import torch

from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
from moe2cta.grouped_gemm.epilogue import Activation, GemmStage
from moe2cta.serving_bench.hopper_gemm_bench import make_counts, padded_layout, valid_row_mask

case, kdir = sys.argv[1], sys.argv[2]
shapes = {"gptoss": (5760, 2880, 128, Activation.SWIGLU_OAI, True, 8192, 4),
          "qwen30": (1536, 2048, 128, Activation.SWIGLU, False, 4096, 8),
          "check": (384, 256, 8, Activation.SWIGLU_OAI, True, 8192, 4)}
shape, sched = case.split(":")
n, k, e, act, has_bias, tokens, top_k = shapes[shape]
problem = s90.Sm90Problem(GemmStage.GEMM1, n, k, e, torch.bfloat16, act, has_bias)
scheduler = {"static": s90.Scheduler.STATIC, "dynamic": s90.Scheduler.DYNAMIC}[sched]
copy = s90.wide_config(problem, tile_m=288, tile_n=128, scheduler=scheduler, expert_split=s90.ExpertSplit.EVEN)
tr = dataclasses.replace(copy, a_source=s90.ASource.TOKEN_ROWS)


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
t = time.time()
out_tr = launch(tr, hidden, torch.empty(max_rows, n // 2, dtype=torch.bfloat16, device="cuda"), a_rows, top_k)
torch.cuda.synchronize()
print(case, "token rows ok", round(time.time() - t, 3), "s, bit-equal on valid rows:",
      torch.equal(out_tr[mask], out_copy[mask]), flush=True)
