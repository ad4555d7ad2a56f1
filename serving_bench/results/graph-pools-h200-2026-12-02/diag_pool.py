"""Which graph replays of the triton layer go wrong when its graphs share a pool with other backends' graphs."""
import sys, torch
from moe2cta.presets import get_preset
from moe2cta.serving_bench.backends import BACKENDS, make_expert_weights
from moe2cta.grouped_gemm import triton_grouped_gemm as tg
from moe2cta.grouped_gemm import sm90_grouped_gemm as s90

mode = sys.argv[1]  # shared | separate | capture-warm
T = int(sys.argv[2]) if len(sys.argv) > 2 else 512
preset = get_preset("mixtral-8x7b")
dev = torch.device("cuda")
w = make_expert_weights(preset, dev, seed=1)
names = ["auto", "triton", "cute", "grouped-mm"]
fns = {n: BACKENDS[n].build(preset, w) for n in names}
gen = torch.Generator(device="cpu").manual_seed(0)
inputs = [(torch.randn(T, preset.hidden, generator=gen).to(dev, torch.bfloat16),
           torch.randn(T, preset.num_experts, generator=gen).to(dev)) for _ in range(4)]
ref = {n: [fns[n](*a).clone() for a in inputs] for n in names}
torch.cuda.synchronize()
cap = torch.cuda.graphs.graph.default_capture_stream
print("capture stream before:", cap)
if mode == "capture-warm":
    if cap is None:
        torch.cuda.graphs.graph.default_capture_stream = cap = torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap):
        for n in names:
            fns[n](*inputs[0])
    torch.cuda.current_stream().wait_stream(cap)
    torch.cuda.synchronize()
outs, graphs = {}, {}
shared = torch.cuda.graph_pool_handle()
for n in names:
    side = torch.cuda.Stream()
    print(n, "side stream", side.cuda_stream)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for a in inputs:
            fns[n](*a)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool = shared if mode != "separate" else torch.cuda.graph_pool_handle()
    for i, a in enumerate(inputs):
        g = torch.cuda.CUDAGraph()
        buf = torch.empty_like(ref[n][i])
        with torch.cuda.graph(g, pool=pool):
            buf.copy_(fns[n](*a))
        graphs[n, i], outs[n, i] = g, buf
cap = torch.cuda.graphs.graph.default_capture_stream
print("capture stream:", cap.cuda_stream)
print("triton counters:", {k: (v.data_ptr(), v.tolist()) for k, v in tg._TILE_COUNTERS.items()})
print("cute scratch:", {k: v[0].data_ptr() for k, v in s90._SCRATCH.items()})
bad = 0
for r in range(3 * len(inputs)):
    order = names[r % 4:] + names[:r % 4]
    for n in order:
        i = r % len(inputs)
        graphs[n, i].replay()
        torch.cuda.synchronize()
        ok = torch.equal(outs[n, i], ref[n][i])
        cnt = {k[2]: v.tolist() for k, v in tg._TILE_COUNTERS.items()}
        if not ok:
            bad += 1
        print(f"round {r} {n} r{i}: {'ok' if ok else 'WRONG'}  counters {cnt}")
print(mode, T, "wrong replays:", bad)
