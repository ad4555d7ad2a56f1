"""Timing one backend call: CUDA-graph replay with rotated inputs and CUDA events, or a CPU clock.

CUDA (the method of issue 7):
1. warm-up: the callable runs eagerly on every rotated input (JIT compiles, autotuners settle);
2. capture: one CUDA graph per rotated input, all graphs sharing one memory pool (they are replayed one at
   a time, in order, on one stream, so their scratch memory can overlap); a backend that cannot be
   captured (host syncs) is timed eagerly instead and the note says why;
3. replay: the graphs run round-robin, each replay between two CUDA events; a GPU sleep kernel first lets
   the host queue the replays ahead, so the events measure GPU time, not launch gaps;
4. samples: one per replay, in microseconds; median and percentiles are taken over them.
Rotation: the inputs (hidden states and router logits) come in several copies, enough that they do not
stay in L2 between calls; weights are not copied (every preset's weights exceed the 50-60 MB L2, and
rotated logits route each call to different experts).

CPU: the same protocol with time.perf_counter around eager calls (no graphs, no events).
"""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = ["GraphCapture", "TimingMode", "TimingConfig", "TimingResult", "time_callable", "rotation_count",
           "interleaved_rounds"]


class GraphCapture(enum.Enum):
    TRY = "try"  # capture a CUDA graph; fall back to eager events if capture fails
    NEVER = "never"  # the backend syncs with the host (e.g. the transformers loop): time eagerly


class TimingMode(enum.Enum):
    CUDA_GRAPH = "cuda-graph"
    CUDA_EVENTS = "cuda-events (eager)"
    CPU_CLOCK = "cpu perf_counter"


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    warmup_calls: int = 2  # eager calls per rotated input before capture
    min_samples: int = 10
    max_samples: int = 300
    target_seconds: float = 0.2  # time spent sampling one case
    max_rotation: int = 8
    rotation_bytes: int = 192 << 20  # rotated inputs together exceed this (3x a 60 MB L2)

    def __post_init__(self):
        if self.min_samples < 1 or self.max_samples < self.min_samples:
            raise ValueError(f"samples: expected 1 <= min_samples <= max_samples, got {self.min_samples}, {self.max_samples}")
        if not self.target_seconds > 0:
            raise ValueError(f"target_seconds: expected > 0, got {self.target_seconds}")
        if self.max_rotation < 1:
            raise ValueError(f"max_rotation: expected >= 1, got {self.max_rotation}")


def rotation_count(bytes_per_input: int, config: TimingConfig) -> int:
    """How many copies of the inputs to rotate through so that they do not stay in L2."""
    if bytes_per_input <= 0:
        raise ValueError(f"bytes_per_input: expected > 0, got {bytes_per_input}")
    need = -(-config.rotation_bytes // bytes_per_input)
    return int(max(1, min(config.max_rotation, need)))


@dataclasses.dataclass(frozen=True)
class TimingResult:
    mode: TimingMode
    samples_us: tuple[float, ...]
    note: str = ""

    def percentile(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.samples_us), q))

    @property
    def median_us(self) -> float:
        return self.percentile(50)

    @property
    def mean_us(self) -> float:
        return float(np.mean(self.samples_us))


def _sample_count(estimate_s: float, config: TimingConfig) -> int:
    if estimate_s <= 0:
        return config.max_samples
    return int(min(config.max_samples, max(config.min_samples, config.target_seconds / estimate_s)))


def time_callable(
    fn: Callable[..., object],
    inputs: Sequence[tuple],
    device: torch.device,
    config: TimingConfig = TimingConfig(),
    capture: GraphCapture = GraphCapture.TRY,
) -> TimingResult:
    """Time fn(*inputs[i]) round-robin over the rotated inputs; see the module docstring."""
    if not inputs:
        raise ValueError("inputs: expected at least one tuple of arguments")
    device = torch.device(device)
    if device.type == "cuda":
        return _time_cuda(fn, inputs, config, capture)
    return _time_cpu(fn, inputs, config)


def _time_cpu(fn, inputs, config: TimingConfig) -> TimingResult:
    for _ in range(config.warmup_calls):
        for args in inputs:
            fn(*args)
    start = time.perf_counter()
    for args in inputs:
        fn(*args)
    estimate = (time.perf_counter() - start) / len(inputs)
    samples = []
    for n in range(_sample_count(estimate, config)):
        args = inputs[n % len(inputs)]
        start = time.perf_counter()
        fn(*args)
        samples.append((time.perf_counter() - start) * 1e6)
    return TimingResult(TimingMode.CPU_CLOCK, tuple(samples))


def _capture_graphs(fn, inputs) -> list:
    """One CUDA graph per rotated input, sharing a memory pool; outputs are dropped (scratch only)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in inputs:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for args in inputs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn(*args)
        graphs.append(graph)
    torch.cuda.synchronize()
    return graphs


def _gpu_sleep(seconds: float) -> None:
    """Keep the GPU busy while the host queues work (about 2 GHz; the exact length does not matter)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None and seconds > 0:
        sleep(int(min(seconds, 0.05) * 2e9))


def _event_samples(runners, n: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    _gpu_sleep(n * 20e-6)
    for i in range(n):
        starts[i].record()
        runners[i % len(runners)]()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def interleaved_rounds(replays: dict, rounds: int) -> dict:
    """{key: [us per round]}: every replay once per round, between two CUDA events, in the dict's order rotated by
    one more place each round (another replay first each time), so that clock and power drift fall on all keys
    alike. The A/B probes' timing (layer_padding_probe, layer_placement_probe)."""
    if not replays:
        raise ValueError("replays: expected at least one replay")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected an int >= 1, got {rounds!r}")
    order = list(replays)
    times = {key: [] for key in order}
    starts = [torch.cuda.Event(enable_timing=True) for _ in order]
    ends = [torch.cuda.Event(enable_timing=True) for _ in order]
    for r in range(rounds):
        rotated = order[r % len(order):] + order[:r % len(order)]
        _gpu_sleep(len(order) * 20e-6)
        for key, start, end in zip(rotated, starts, ends):
            start.record()
            replays[key]()
            end.record()
        torch.cuda.synchronize()
        for key, start, end in zip(rotated, starts, ends):
            times[key].append(start.elapsed_time(end) * 1e3)
    return times


def _time_cuda(fn, inputs, config: TimingConfig, capture: GraphCapture) -> TimingResult:
    for _ in range(config.warmup_calls):
        for args in inputs:
            fn(*args)
    torch.cuda.synchronize()
    note = ""
    graphs = None
    if capture is GraphCapture.TRY:
        try:
            graphs = _capture_graphs(fn, inputs)
        except Exception as exc:  # a backend that syncs inside: time it eagerly, say so
            note = f"graph capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}); timed eagerly"
            graphs = None
            torch.cuda.synchronize()
    else:
        note = "backend syncs with the host; timed eagerly"
    if graphs is not None:
        runners = [g.replay for g in graphs]
        mode = TimingMode.CUDA_GRAPH
    else:
        runners = [lambda args=args: fn(*args) for args in inputs]
        mode = TimingMode.CUDA_EVENTS
    try:
        for run in runners:  # replay warm-up
            run()
        estimate = float(np.median(_event_samples(runners, max(3, len(runners))))) * 1e-6
        samples = _event_samples(runners, _sample_count(estimate, config))
    finally:
        del runners
        graphs = None
        torch.cuda.synchronize()
    return TimingResult(mode, tuple(samples), note)
