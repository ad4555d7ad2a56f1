"""Diagnostic (stop 54, call 2): the token GEMVs alone, gpt-oss-120b and qwen3-30b-a3b shapes at T = 1 and 4, with
int32 ids + fp32 weights against int64 ids + bf16 weights, in the same interleaved rounds (graph replay, 4 rotated
inputs). Prints medians and p10 / p90 per kernel pair."""
import statistics
import sys

import torch

from moe2cta.grouped_gemm import triton_token_gemv as tk
from moe2cta.grouped_gemm.epilogue import W13Layout, pack_gate_up_rows
from moe2cta.serving_bench.backends import make_expert_weights
from moe2cta.serving_bench.timing import TimingConfig, time_interleaved
from moe2cta.presets import get_preset

for name in sys.argv[1:]:
    preset = get_preset(name)
    weights = make_expert_weights(preset, torch.device("cuda"), seed=0)
    w13 = pack_gate_up_rows(weights.w13)
    for tokens in (1, 4):
        gen = torch.Generator().manual_seed(tokens)
        inputs = []
        for _ in range(4):
            hidden = torch.randn(tokens, preset.hidden, generator=gen).to("cuda", torch.bfloat16)
            ids = torch.stack([torch.randperm(preset.num_experts, generator=gen)[:preset.top_k] for _ in range(tokens)])
            w = torch.rand(tokens, preset.top_k, generator=gen).to("cuda", torch.bfloat16)
            inputs.append((hidden, ids.to("cuda", torch.int32), w.float(), ids.to("cuda", torch.int64), w))

        def chain(h, ids, w):
            a2 = tk.token_gemv1(h, ids, w13, preset.activation, b13=weights.b13, w13_layout=W13Layout.CHUNKED)
            return tk.token_gemv2_combine(a2, ids, weights.w2, w, b2=weights.b2)

        fns = {"int32+fp32": lambda h, i32, w32, i64, wb: chain(h, i32, w32),
               "int64+bf16": lambda h, i32, w32, i64, wb: chain(h, i64, wb)}
        for repeat in range(2):
            res = time_interleaved(fns, inputs, torch.device("cuda"), TimingConfig(max_rotation=4, target_seconds=0.5))
            print(name, "T=%d" % tokens, "  ".join(
                f"{k} {statistics.median(r.samples_us):7.2f} [{r.percentile(10):.2f}, {r.percentile(90):.2f}]"
                for k, r in res.items()), flush=True)
