"""Stop 47, call 4: does a write-heavy stream run under the read-plus-write copy rate on the H200?

The gather runs at 1.15-1.32x of its bytes' floor (4-8 bytes written per byte read), the combine (the reverse) at
0.98-1.10x. Three plain streams over the same 1.9 GB, CUDA graphs of 10 launches, median of 15 replays:
- copy: y.copy_(x), as many bytes read as written (the floor's bandwidth: bytes read + written per second);
- fill: y.fill_(v), write only;
- read: a column sum over the matrix, read only (a 16 KB output).
Each rate is bytes moved (read + written) per second.
"""
import torch

torch.manual_seed(0)
dev = torch.device("cuda")


def graph_us(fn, reps=10, rounds=15):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


rows, cols = 131072, 7168  # deepseek-v3 T=16384, k=8: 1.9 GB of bf16 rows
x = torch.randn(rows, cols, device=dev).to(torch.bfloat16)
y = torch.empty_like(x)
colsum = torch.empty(8192, device=dev, dtype=torch.float32)
nbytes = x.numel() * x.element_size()
cases = [
    ("copy (read 1 : write 1)", lambda: y.copy_(x), 2 * nbytes),
    ("fill (write only)", lambda: y.fill_(0.5), nbytes),
    ("read (column sums)", lambda: torch.sum(x.view(-1, 8192), dim=0, dtype=torch.float32, out=colsum), nbytes),
]
print(f"{'case':28s} {'us':>9s} {'TB/s':>6s}")
for name, fn, moved in cases:
    us = graph_us(fn)
    print(f"{name:28s} {us:9.1f} {moved / us / 1e6:6.2f}")
