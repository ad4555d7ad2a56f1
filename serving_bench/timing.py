"""Timing one backend call: CUDA-graph replay with rotated inputs and CUDA events, or a CPU clock.

CUDA (the method of issue 7):
1. warm-up: the callable runs eagerly on every rotated input (JIT compiles, autotuners settle);
2. capture: one CUDA graph per rotated input, all graphs sharing one memory pool (they are replayed one at
   a time, in order, on one stream, so their scratch memory can overlap); a backend that cannot be
   captured (host syncs) is timed eagerly instead and the note says why;
3. replay: the graphs run round-robin, each replay between two CUDA events; a GPU sleep kernel first lets
   the host queue the replays ahead, so the events measure GPU time, not launch gaps;
4. samples: one per replay, in microseconds; median and percentiles are taken over them. Sample i ran rotated
   input (first_rotation + i) % len(inputs) (TimingResult.rotation_of), so a caller can relate each sample to its own
   input;
5. outputs: every rotation's graph output is kept (so that no later capture allocates over it); after the rounds
   each is filled with NaN and its graph replays once more, alone, and the caller's `check(name, rotation, output)`
   reads it right then (NaN where the graph writes nothing). Read right after its own replay: the graphs share one
   pool, so another rotation's replay may write its scratch over it. TimingResult.checks holds what `check` returned
   per rotation, and TimingResult.output rotation 0's output.
Clock reading (`ClockReading.NVML`, the default on CUDA): NVML is read every 5 ms while a case's samples run, and the
result carries the median SM clock and board power over that window (the same reading for every callable timed in the
same rounds; none where the driver's NVML library is missing, or where the window held no reading). It says which
clock a median was taken at: on the H200 the same layer differs by up to 14% between the boost and the capped clock
(results/stop46-h200-2026-12-04). NVML's power is a running average: it lags a short window (a case sampled right after
a rest reads well under what it draws), so only a settled case's power means much.
With `settle_seconds` the replays of step 3 first run untimed for that long, so that the samples see the clock a
sustained load holds: on the power-capped H200 the first ~0.1 s after a rest run at the boost clock (1980 MHz, a
forward 10% faster), then the power cap sets in (results/stop44-h200-2026-12-04). Default 0: samples start right
after the warm-up, and a short case's samples may fall on either clock.
Several callables (the backends of one benchmark cell) are timed in the same rounds by `time_interleaved`: round r
replays rotated input (r + j) % n of the j-th callable (TimingResult.first_rotation = j % n: where there are at least
as many inputs as callables, no two callables of a round run the same input, so that none finds the experts another
just streamed in L2; at prefill sizes there are only 1-2 inputs, but also far more weight bytes than L2), in orders of
a balanced Latin square (each callable first equally often,
and after each other callable equally often), so that the card's clock drift falls on all of them alike. On a
power-capped card each replay still inherits the clock its predecessor's power draw left (runner.BackendOrder says
what that did on the H200). Each callable's graphs have their own memory pool, as when it is timed alone. One
callable alone is the plain round-robin above (`time_callable`).
Rotation: the inputs (hidden states and router logits) come in up to `max_rotation` copies, together
`rotation_bytes` where that cap allows; weights are not copied (every preset's weights exceed the 50-60 MB L2, and
rotated logits route each call to different experts). Where the cap binds (small T), the copies together fit in L2;
what keeps them out is the weight stream between two uses of one copy (at least the ~75 MB of 8 experts of the
smallest preset per call): a custom shape of a few MB of weights would be timed partly from L2.

CPU: the same protocol with time.perf_counter around eager calls (no graphs, no events).
"""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Callable, Sequence

import numpy as np
import torch

from moe2cta.capture import capture_cuda_graph

__all__ = ["ClockReading", "ClockWindow", "GraphCapture", "TimingMode", "TimingConfig", "TimingResult", "clock_window",
           "time_callable", "time_interleaved", "rotation_count", "interleaved_rounds", "balanced_orders"]


class GraphCapture(enum.Enum):
    TRY = "try"  # capture a CUDA graph; fall back to eager events if capture fails
    NEVER = "never"  # the backend syncs with the host (e.g. the transformers loop): time eagerly


class ClockReading(enum.Enum):
    NONE = "none"
    NVML = "nvml"  # SM clock and board power over each case's samples (module docstring)


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
    settle_seconds: float = 0.0  # untimed replays before each case's samples (module docstring)
    clock_reading: ClockReading = ClockReading.NVML  # CUDA only

    def __post_init__(self):
        if not isinstance(self.clock_reading, ClockReading):
            raise TypeError(f"clock_reading: expected a ClockReading, got {self.clock_reading!r}")
        if not 0 <= self.settle_seconds < float("inf"):
            raise ValueError(f"settle_seconds: expected a finite number >= 0, got {self.settle_seconds}")
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
class ClockWindow:
    """Medians of the NVML readings taken while one case's samples ran."""

    sm_mhz: float
    power_w: float
    readings: int


@dataclasses.dataclass(frozen=True)
class TimingResult:
    mode: TimingMode
    samples_us: tuple[float, ...]
    note: str = ""
    clock: ClockWindow | None = None  # SM clock and power while the samples ran (ClockReading.NVML)
    rotations: int = 1  # sample i ran rotated input (first_rotation + i) % rotations
    # CUDA graphs: rotation 0's output from one replay after the rounds (module docstring); else None
    output: object = dataclasses.field(default=None, repr=False, compare=False)
    first_rotation: int = 0
    # CUDA graphs with a `check`: its result for each rotation's output, read after the rounds (module docstring)
    checks: tuple = dataclasses.field(default=(), repr=False, compare=False)

    def rotation_of(self, sample: int) -> int:
        """The rotated input sample `sample` ran."""
        return (self.first_rotation + sample) % self.rotations

    def percentile(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.samples_us), q))

    @property
    def median_us(self) -> float:
        return self.percentile(50)

    @property
    def mean_us(self) -> float:
        return float(np.mean(self.samples_us))


CLOCK_PERIOD_S = 0.005  # NVML reading period while samples run


def _clock_sampler(config: TimingConfig, on_cuda: bool):
    """A PowerSampler on the current CUDA device's NVML handle, or None (no reading asked for, no CUDA, no NVML
    library: nvidia-smi's tens of ms per reading are too slow for a case's window). The NVML index is taken to be the
    CUDA index (true unless CUDA_VISIBLE_DEVICES reorders the devices)."""
    if config.clock_reading is ClockReading.NONE or not on_cuda:
        return None
    from .power import PowerSampler

    sampler = PowerSampler(device_index=torch.cuda.current_device(), period_s=CLOCK_PERIOD_S)
    return sampler if sampler.backend() == "nvml" else None


def _stop_reading(sampler) -> list:
    """The sampler's readings ([] without one, or where a read failed: a case is timed whether or not NVML answers)."""
    if sampler is None:
        return []
    try:
        return sampler.stop()
    except RuntimeError:
        return []


def clock_window(readings, t_from: float, t_to: float) -> ClockWindow | None:
    """Medians of the readings (PowerSample) taken in [t_from, t_to]; a window shorter than the reading period gets
    the reading nearest its middle if one lies within a period of it, else None."""
    inside = [r for r in readings if t_from <= r.t <= t_to]
    if not inside:
        middle = (t_from + t_to) / 2
        near = [r for r in readings if abs(r.t - middle) <= (t_to - t_from) / 2 + CLOCK_PERIOD_S]
        inside = sorted(near, key=lambda r: abs(r.t - middle))[:1]
    if not inside:
        return None
    return ClockWindow(float(np.median([r.sm_mhz for r in inside])), float(np.median([r.power_w for r in inside])),
                       len(inside))


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
    """Time fn(*inputs[i]) round-robin over the rotated inputs; see the module docstring. Raises what fn raises."""
    result = time_interleaved({"fn": fn}, inputs, device, config, {"fn": capture})["fn"]
    if isinstance(result, BaseException):
        raise result
    return result


def time_interleaved(
    fns: dict[str, Callable[..., object]],
    inputs: Sequence[tuple],
    device: torch.device,
    config: TimingConfig = TimingConfig(),
    captures: dict[str, GraphCapture] | None = None,
    check: Callable[[str, int, object], object] | None = None,
) -> dict[str, TimingResult | Exception]:
    """{name: TimingResult}: every fns[name](*inputs[i]) timed in the same rounds (module docstring), each with the
    same number of samples. A callable that raises (warm-up, capture fallback or replay) gets its exception in place
    of a result and leaves the rounds; the others go on. captures: GraphCapture per name (default TRY). check(name,
    rotation, output): called on each graphed callable's output of each rotation, replayed alone after the rounds."""
    if not fns:
        raise ValueError("fns: expected at least one callable")
    if not inputs:
        raise ValueError("inputs: expected at least one tuple of arguments")
    captures = captures or {}
    unknown = set(captures) - set(fns)
    if unknown:
        raise ValueError(f"captures: names {sorted(unknown)} are not in fns")
    on_cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    failed: dict[str, Exception] = {}
    for name, fn in fns.items():
        try:
            for _ in range(config.warmup_calls):
                for args in inputs:
                    fn(*args)
            sync()
        except Exception as exc:
            failed[name] = exc
    runners, modes, notes, outputs = {}, {}, {}, {}
    for name, fn in fns.items():
        if name in failed:
            continue
        # one memory pool per callable (shared by its rotated inputs' graphs), as when each is timed alone
        pool = torch.cuda.graph_pool_handle() if on_cuda else None
        capture = captures.get(name, GraphCapture.TRY)
        runners[name], modes[name], notes[name], outputs[name] = _runners(fn, inputs, on_cuda, capture, pool)
    samples, clock = _rounds(runners, failed, config, on_cuda)
    first_rotation = {name: j % len(inputs) for j, name in enumerate(runners)}  # (_sample_rounds' offsets)
    checks = {}
    for name in list(runners):  # what each rotation's graph writes, read right after its own replay
        checks[name] = []
        for rotation, output in enumerate(outputs.get(name) or ()):
            if not (isinstance(output, torch.Tensor) and output.is_floating_point()):
                checks[name].append(None)  # (kept by rotation: checks[name][r] is rotation r's)
                continue
            try:
                output.fill_(float("nan"))
                runners[name][rotation]()
                torch.cuda.synchronize()
                checks[name].append(check(name, rotation, output) if check is not None else None)
            except Exception as exc:
                failed[name] = exc
                break
    out: dict[str, TimingResult | Exception] = {}
    for name in fns:
        kept = outputs.get(name) or (None,)
        out[name] = failed[name] if name in failed else TimingResult(
            modes[name], tuple(samples[name]), notes[name], clock, len(inputs), kept[0], first_rotation[name],
            tuple(checks.get(name, ())))
    return out


def _runners(fn, inputs, on_cuda: bool, capture: GraphCapture, pool):
    """(replay callables, one per rotated input; mode; note; each rotation's graph output, None when not graphed)."""
    eager = [lambda args=args: fn(*args) for args in inputs]
    if not on_cuda:
        return eager, TimingMode.CPU_CLOCK, "", None
    if capture is GraphCapture.NEVER:
        return eager, TimingMode.CUDA_EVENTS, "backend syncs with the host; timed eagerly", None
    try:
        graphs, graph_outputs = _capture_graphs(fn, inputs, pool)
    except Exception as exc:  # a backend that syncs inside: time it eagerly, say so
        torch.cuda.synchronize()
        text = str(exc).splitlines()[0][:120] if str(exc) else ""
        return eager, TimingMode.CUDA_EVENTS, f"graph capture failed ({type(exc).__name__}: {text}); timed eagerly", None
    return [g.replay for g in graphs], TimingMode.CUDA_GRAPH, "", graph_outputs


def _rounds(runners: dict, failed: dict, config: TimingConfig, on_cuda: bool) -> tuple[dict[str, list[float]],
                                                                                        ClockWindow | None]:
    """Warm-up replays, an estimate of each runner's time, then the timed rounds (with the clock window of the rounds
    that gave the samples); moves raisers into `failed`."""
    estimates = {}
    for name, calls in list(runners.items()):
        try:
            for call in calls:
                call()
            estimates[name] = float(np.median(_sample_rounds({name: calls}, max(3, len(calls)), on_cuda)[name])) * 1e-6
        except Exception as exc:
            failed[name] = exc.cause if isinstance(exc, _RunnerFailed) else exc
            del runners[name]
    if not runners:
        return {}, None
    rounds = _sample_count(float(np.mean(list(estimates.values()))), config)
    while runners:
        try:
            _settle(runners, config.settle_seconds, on_cuda)
            break
        except _RunnerFailed as exc:
            failed[exc.name] = exc.cause
            del runners[exc.name]
    if not runners:
        return {}, None
    sampler = _clock_sampler(config, on_cuda)
    while True:
        clock = _ClockRead(sampler) if sampler is not None else None
        try:
            return _sample_rounds(runners, rounds, on_cuda, clock), None if clock is None else clock.window
        except _RunnerFailed as exc:  # drop the raiser, time the rest again
            failed[exc.name] = exc.cause
            del runners[exc.name]
            if not runners:
                return {}, None


def _settle(runners: dict, seconds: float, on_cuda: bool) -> None:
    """Every runner's calls round-robin, untimed, until `seconds` of wall time have passed (0: none)."""
    end = time.perf_counter() + seconds
    turn = 0
    while time.perf_counter() < end:
        for name, calls in runners.items():
            try:
                calls[turn % len(calls)]()
            except Exception as exc:
                if on_cuda:
                    torch.cuda.synchronize()
                raise _RunnerFailed(name, exc) from exc
        if on_cuda:
            torch.cuda.synchronize()  # (the host clock then measures the device's time)
        turn += 1


class _RunnerFailed(Exception):
    def __init__(self, name, cause):
        super().__init__(name)
        self.name, self.cause = name, cause


def balanced_orders(n: int) -> list[list[int]]:
    """The orders of n callables for successive rounds: a Williams design (a balanced Latin square), in which every
    callable runs first equally often and follows every other callable equally often, so that neither the position
    in a round nor the previous callable's heat or power draw favours one of them. n rows for even n, 2n for odd n."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an int >= 1, got {n!r}")
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


class _ClockRead:
    """NVML readings while the host waits for the queued rounds: the sampler's thread starts only once every round is
    queued (it takes no host time from the queueing), so the window runs from the end of the GPU sleep (or of the
    queueing, if that took longer) to the end of the last round."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.window: ClockWindow | None = None

    def wait(self) -> None:
        self.sampler.start()
        t_from = time.time()
        try:
            torch.cuda.synchronize()
        finally:
            t_to = time.time()
            readings = _stop_reading(self.sampler)
        self.window = clock_window(readings, t_from, t_to)


def _sample_rounds(runners: dict, rounds: int, on_cuda: bool, clock: _ClockRead | None = None) -> dict[str, list[float]]:
    """{name: one sample in us per round}; round r runs runners[name][(r + i) % len] for the i-th name, in the order
    of row r of balanced_orders; CUDA: all rounds queued behind a GPU sleep, between CUDA events, and `clock` (if
    given) reads NVML while they run; CPU: perf_counter around each call."""
    order = list(runners)
    squares = balanced_orders(len(order))
    # the i-th runner starts at its rotation i: no two runners of a round replay the same input (module docstring)
    plan = [(order[i], runners[order[i]][(r + i) % len(runners[order[i]])]) for r in range(rounds)
            for i in squares[r % len(squares)]]
    if not on_cuda:
        samples = {name: [] for name in order}
        for name, call in plan:
            start = time.perf_counter()
            try:
                call()
            except Exception as exc:
                raise _RunnerFailed(name, exc) from exc
            samples[name].append((time.perf_counter() - start) * 1e6)
        return samples
    starts = [torch.cuda.Event(enable_timing=True) for _ in plan]
    ends = [torch.cuda.Event(enable_timing=True) for _ in plan]
    _gpu_sleep(len(plan) * 20e-6)
    slept = torch.cuda.Event()
    slept.record()
    for (name, call), start, end in zip(plan, starts, ends):
        start.record()
        try:
            call()
        except Exception as exc:
            torch.cuda.synchronize()
            raise _RunnerFailed(name, exc) from exc
        end.record()
    slept.synchronize()
    if clock is not None:
        clock.wait()
    else:
        torch.cuda.synchronize()
    samples = {name: [] for name in order}
    for (name, _), start, end in zip(plan, starts, ends):
        samples[name].append(start.elapsed_time(end) * 1e3)
    return samples


def _capture_graphs(fn, inputs, pool=None) -> tuple[list, list]:
    """(one CUDA graph per rotated input, in one memory pool (`pool`, else a new one); each graph's output, kept so
    that no later capture allocates over it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in inputs:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    graphs, outputs = [], []
    for args in inputs:
        graph = torch.cuda.CUDAGraph()
        with capture_cuda_graph(graph, pool=pool):  # a failed capture leaves the stream and torch's RNG as they were
            out = fn(*args)
        graphs.append(graph)
        outputs.append(out)
        del out
    torch.cuda.synchronize()
    return graphs, outputs


def _gpu_sleep(seconds: float) -> None:
    """Keep the GPU busy while the host queues work (about 2 GHz; the exact length does not matter)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None and seconds > 0:
        sleep(int(min(seconds, 0.05) * 2e9))


def interleaved_rounds(replays: dict, rounds: int) -> dict:
    """{key: [us per round]}: every replay once per round, between two CUDA events, in the orders of
    balanced_orders, so that clock and power drift fall on all keys alike. The A/B probes' timing (layer_padding_probe,
    layer_placement_probe)."""
    if not replays:
        raise ValueError("replays: expected at least one replay")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected an int >= 1, got {rounds!r}")
    try:
        return _sample_rounds({key: [replay] for key, replay in replays.items()}, rounds, on_cuda=True)
    except _RunnerFailed as exc:
        raise exc.cause from None
