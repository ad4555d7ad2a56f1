"""Stop 44 probe: are a grid case's two sample levels the card's clock steps? One layer (qwen3-235b-a22b's shape,
T=8192, backend cute, the grid's defaults), four CUDA graphs on rotated inputs, replayed one at a time for
`--seconds` after `--idle` seconds of rest, each replay timed with events and stamped with the host time, while
PowerSampler (NVML) reads SM clock, power and clock event reasons every 5 ms. Prints time bins (median replay ms,
median SM clock, power, the reasons set) and writes every replay and sample to --out (JSON)."""
import argparse
import json
import statistics
import time

import torch

from moe2cta import MoELayer, RoutingConfig
from moe2cta.serving_bench.power import ClockEventReason, PowerSampler

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=8192)
p.add_argument("--seconds", type=float, default=5.0)
p.add_argument("--idle", type=float, default=2.0)
p.add_argument("--out", required=True)
args = p.parse_args()
hidden_size, inter, experts, top_k = 4096, 1536, 128, 8  # qwen3-235b-a22b
gen = torch.Generator(device="cuda").manual_seed(0)
dev, bf = "cuda", torch.bfloat16
w13 = (torch.randn(experts, 2 * inter, hidden_size, generator=gen, device=dev) * hidden_size ** -0.5).to(bf)
w2 = (torch.randn(experts, hidden_size, inter, generator=gen, device=dev) * inter ** -0.5).to(bf)
moe = MoELayer(w13, w2, routing=RoutingConfig(top_k=top_k), backend="cute")
inputs = [(torch.randn(args.tokens, hidden_size, generator=gen, device=dev).to(bf),
           torch.randn(args.tokens, experts, generator=gen, device=dev)) for _ in range(4)]
graphs = []
for h, lg in inputs:
    moe(h, lg)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        moe(h, lg)
    graphs.append(g)
for g in graphs:
    g.replay()
torch.cuda.synchronize()
sampler = PowerSampler(period_s=0.005)
sampler.start()
time.sleep(args.idle)
replays = []
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
t0 = time.time()
i = 0
while time.time() - t0 < args.seconds:
    start.record()
    graphs[i % 4].replay()
    end.record()
    end.synchronize()
    replays.append((time.time(), start.elapsed_time(end)))
    i += 1
time.sleep(0.2)
samples = sampler.stop()
json.dump({"replays": replays, "samples": [s.__dict__ for s in samples], "t0": t0}, open(args.out, "w"))
print(f"{len(replays)} replays, {len(samples)} samples; replay ms p10 / p50 / p90: "
      + " / ".join(f"{statistics.quantiles([r[1] for r in replays], n=10)[q]:.3f}" for q in (0, 4, 8)))
print("   t s  replays  replay ms   SM MHz  power W  reasons")
# the last 0.5 s of rest in one bin, the first 0.6 s of replays in 20 ms bins (a grid case samples for 0.05 s),
# then 250 ms bins
edges = [-0.5, 0.0] + [0.02 * k for k in range(1, 31)] + [0.6 + 0.25 * k for k in range(1, int(args.seconds / 0.25))]
for lo_rel, hi_rel in zip(edges, edges[1:]):
    lo, hi = t0 + lo_rel, t0 + hi_rel
    rs = [r[1] for r in replays if lo <= r[0] < hi]
    ss = [s for s in samples if lo <= s.t < hi]
    if not ss:
        continue
    reasons = 0
    for s in ss:
        reasons |= s.reasons
    names = ",".join(r.name for r in ClockEventReason if reasons & r) or "-"
    print(f"{lo - t0:6.2f} {len(rs):8d} {statistics.median(rs) if rs else float('nan'):10.3f} "
          f"{statistics.median(s.sm_mhz for s in ss):8.0f} {statistics.median(s.power_w for s in ss):8.0f}  {names}")
