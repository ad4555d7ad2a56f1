"""Diagnostic (stop 54, call 3, not yet run): which dtype makes gpt-oss-120b's token GEMVs slower at T=1 (call 2: int64
ids + bf16 weights 66.7-67.0 us against 60.2-60.5 for int32 + fp32; the loop bodies differ only in ptxas's instruction
order)? GEMV1 alone with int32 / int64 ids, GEMV2 alone with the four (ids, weights) dtype pairs, each set in its own interleaved rounds
(graph replay, 4 rotated inputs, 0.5 s), twice. Prints medians and p10 / p90."""
import statistics
import sys

import torch

from moe2cta.grouped_gemm import triton_token_gemv as tk
from moe2cta.grouped_gemm.epilogue import W13Layout, pack_gate_up_rows
from moe2cta.presets import get_preset
from moe2cta.serving_bench.backends import make_expert_weights
from moe2cta.serving_bench.timing import TimingConfig, time_interleaved

name, tokens = sys.argv[1], int(sys.argv[2])
preset = get_preset(name)
weights = make_expert_weights(preset, torch.device("cuda"), seed=0)
w13 = pack_gate_up_rows(weights.w13)
gen = torch.Generator().manual_seed(tokens)
inputs = []
for _ in range(4):
    hidden = torch.randn(tokens, preset.hidden, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(preset.num_experts, generator=gen)[:preset.top_k] for _ in range(tokens)])
    w = torch.rand(tokens, preset.top_k, generator=gen).to("cuda", torch.bfloat16)
    i32, i64 = ids.to("cuda", torch.int32), ids.to("cuda", torch.int64)
    a2 = tk.token_gemv1(hidden, i32, w13, preset.activation, b13=weights.b13, w13_layout=W13Layout.CHUNKED)
    inputs.append((hidden, a2, i32, i64, w.float(), w))


def gemv1(h, ids):
    return tk.token_gemv1(h, ids, w13, preset.activation, b13=weights.b13, w13_layout=W13Layout.CHUNKED)


def gemv2(a2, ids, w):
    return tk.token_gemv2_combine(a2, ids, weights.w2, w, b2=weights.b2)


sets = {
    "GEMV1": {"ids32": lambda h, a2, i32, i64, w32, wb: gemv1(h, i32),
              "ids64": lambda h, a2, i32, i64, w32, wb: gemv1(h, i64)},
    "GEMV2": {"ids32 w32": lambda h, a2, i32, i64, w32, wb: gemv2(a2, i32, w32),
              "ids64 w32": lambda h, a2, i32, i64, w32, wb: gemv2(a2, i64, w32),
              "ids32 wbf16": lambda h, a2, i32, i64, w32, wb: gemv2(a2, i32, wb),
              "ids64 wbf16": lambda h, a2, i32, i64, w32, wb: gemv2(a2, i64, wb)},
}
for repeat in range(int(sys.argv[3]) if len(sys.argv) > 3 else 2):
    for label, fns in sets.items():
        res = time_interleaved(fns, inputs, torch.device("cuda"), TimingConfig(max_rotation=4, target_seconds=0.5))
        print(name, f"T={tokens}", label, "  ".join(
            f"{k} {statistics.median(r.samples_us):7.2f} [{r.percentile(10):.2f}, {r.percentile(90):.2f}]"
            for k, r in res.items()), flush=True)
