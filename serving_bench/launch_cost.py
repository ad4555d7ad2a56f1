"""Host cost of the primitives an eager MoE forward is made of, on this machine: a Python call, a torch allocation, a
torch kernel launch, and a Triton kernel launched three ways (the JIT's `kernel[grid](...)`, the compiled kernel's
runner, and its raw launcher).

    python -m moe2cta.serving_bench.launch_cost [--calls 200] [--rounds 7] [--json FILE]

Each primitive runs `--calls` times per round while the GPU sleeps behind a long sleep kernel (the host never waits
for the GPU); the figure is the median over `--rounds` rounds of host microseconds per call. It calibrates
host_overhead's per-forward figures: how much of a forward's host time is launches the layer cannot avoid, and how
much is its own Python. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

__all__ = ["measure", "main"]

SLEEP_CYCLES_PER_CALL = 200_000  # ~0.1 ms of GPU sleep per timed call: longer than any host call measured here


def _probe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def probe(a, b, c, d, e, f, n0, n1, n2, n3, BLOCK: tl.constexpr, FLAG: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n0
        x = tl.load(a + offs, mask=mask, other=0.0)
        if FLAG:
            x = x + n1 + n2 + n3
        tl.store(b + offs, x, mask=mask)

    return probe


def _per_call_us(fn, calls: int, rounds: int) -> float:
    """Median host us per call of fn() over `rounds` rounds of `calls` calls, launched behind a GPU sleep."""
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES_PER_CALL * calls)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append(1e6 * (time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return statistics.median(samples)


def measure(calls: int = 200, rounds: int = 7) -> dict[str, float]:
    """{primitive: host us per call}."""
    dev = torch.device("cuda")
    probe = _probe_kernel()
    tensors = [torch.zeros(4096, device=dev) for _ in range(6)]
    a, b, c, d, e, f = tensors
    stream = torch.cuda.current_stream()
    compiled = probe[(4,)](a, b, c, d, e, f, 1000, 17, 32, 5, BLOCK=256, FLAG=1)  # compiles once
    torch.cuda.synchronize()
    runner = compiled[(4, 1, 1)]
    raw_stream = stream.cuda_stream
    fn_handle = compiled.function
    packed = compiled.packed_metadata

    def noop():
        return None

    def jit_launch():
        probe[(4,)](a, b, c, d, e, f, 1000, 17, 32, 5, BLOCK=256, FLAG=1)

    def runner_launch():
        runner(a, b, c, d, e, f, 1000, 17, 32, 5, 256, 1, stream=raw_stream)

    def raw_launch():
        compiled.run(4, 1, 1, raw_stream, fn_handle, packed, None, None, None, a, b, c, d, e, f, 1000, 17, 32, 5, 256, 1)

    primitives = {
        "python call": noop,
        "torch.empty": lambda: torch.empty(4096, device=dev),
        "torch.cuda.current_stream": torch.cuda.current_stream,
        "torch.cuda.current_device": torch.cuda.current_device,
        "torch.cuda.get_device_properties": lambda: torch.cuda.get_device_properties(dev),
        "tensor.device": lambda: a.device,
        "tensor.shape[0]": lambda: a.shape[0],
        "tensor.data_ptr()": a.data_ptr,
        "tensor view (a[:100])": lambda: a[:100],
        "torch kernel (x.add_(1))": lambda: a.add_(1),
        "triton JIT launch (12 args)": jit_launch,
        "triton compiled runner": runner_launch,
        "triton raw launcher": raw_launch,
    }
    report = {}
    for name, fn in primitives.items():
        try:
            fn()
            report[name] = _per_call_us(fn, calls, rounds)
        except Exception as exc:  # a Triton version without the runner API: say so, keep the others
            report[name] = f"failed: {type(exc).__name__}: {exc}"
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per round (default 200: they fit the launch queue)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the median is reported (default 7)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.calls > 900:
        parser.error(f"--calls: expected 1..900 (the launch queue holds about 1000), got {args.calls}")
    if args.rounds < 1:
        parser.error(f"--rounds: expected >= 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("launch_cost needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    report = measure(args.calls, args.rounds)
    print(f"host us per call (torch {torch.__version__}, triton {triton.__version__}, median of {args.rounds} x {args.calls})")
    for name, value in report.items():
        print(f"  {name:32s} {value:8.2f}" if isinstance(value, float) else f"  {name:32s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "triton": triton.__version__, "host_us_per_call": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
