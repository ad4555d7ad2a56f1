"""The serving trace: Poisson arrivals, continuous batching into steps, per-step MoE latency.

Requests arrive as a Poisson process (exponential gaps at `arrival_rate` per second) with lognormal prompt
and output lengths. A continuous-batching scheduler in the style of vLLM's chunked prefill builds steps:
every running request that has finished its prompt contributes one decode token, and the rest of the
step's token budget goes to prefill chunks (requests part-way through their prompt first, then waiting
requests in arrival order, up to `max_running` requests in flight). The step that completes a prompt also
produces the request's first output token. The clock advances by a nominal `step_seconds` per step (a
whole model step, not just this layer), so every backend sees the same sequence of steps.

A step of T tokens runs at the next bucket size >= T (as a CUDA-graph engine pads to captured sizes);
each bucket is measured once per backend, and each step draws one of its bucket's timing samples, so the
per-step percentiles include the run-to-run spread. tokens/s counts real (unpadded) tokens over the
sum of per-step MoE latencies of this one layer.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

__all__ = [
    "TraceConfig",
    "Request",
    "Step",
    "generate_requests",
    "schedule_steps",
    "BUCKETS",
    "bucket_tokens",
    "TraceStats",
    "trace_stats",
    "StepLatency",
    "step_latencies",
]


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    num_requests: int = 200
    arrival_rate: float = 8.0  # requests per second
    mean_prompt_tokens: int = 1024
    mean_output_tokens: int = 256
    max_prompt_tokens: int = 16384
    max_output_tokens: int = 4096
    token_budget: int = 8192  # tokens per step, decode + prefill chunks
    max_running: int = 256  # requests in flight
    step_seconds: float = 0.025  # nominal duration of one whole model step
    seed: int = 0

    def __post_init__(self):
        for name in ("num_requests", "mean_prompt_tokens", "mean_output_tokens", "token_budget", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if not (self.arrival_rate > 0 and self.step_seconds > 0):
            raise ValueError(f"arrival_rate, step_seconds: expected > 0, got {self.arrival_rate}, {self.step_seconds}")
        if self.max_prompt_tokens < self.mean_prompt_tokens or self.max_output_tokens < self.mean_output_tokens:
            raise ValueError("max_prompt_tokens / max_output_tokens: expected >= the means")

    def describe(self) -> str:
        return (
            f"{self.num_requests} requests, Poisson {self.arrival_rate:g}/s, prompt ~{self.mean_prompt_tokens} "
            f"and output ~{self.mean_output_tokens} tokens (lognormal), budget {self.token_budget} tokens/step, "
            f"<= {self.max_running} running, {self.step_seconds * 1e3:g} ms nominal step"
        )


@dataclasses.dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclasses.dataclass(frozen=True)
class Step:
    time_s: float
    decode_tokens: int
    prefill_tokens: int
    prefill_chunks: int

    @property
    def num_tokens(self) -> int:
        return self.decode_tokens + self.prefill_tokens


def _lognormal_lengths(rng, mean: int, upper: int, n: int, sigma: float = 1.0) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), 1, upper).astype(np.int64)


def generate_requests(config: TraceConfig) -> list[Request]:
    """The requests of the trace, in arrival order (deterministic in config.seed)."""
    rng = np.random.default_rng(config.seed)
    arrivals = np.cumsum(rng.exponential(1.0 / config.arrival_rate, size=config.num_requests))
    prompts = _lognormal_lengths(rng, config.mean_prompt_tokens, config.max_prompt_tokens, config.num_requests)
    outputs = _lognormal_lengths(rng, config.mean_output_tokens, config.max_output_tokens, config.num_requests)
    return [Request(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]


@dataclasses.dataclass
class _Running:
    prompt_left: int
    output_left: int


def schedule_steps(requests: Sequence[Request], config: TraceConfig) -> list[Step]:
    """Continuous batching of `requests` into steps (see the module docstring)."""
    pending = collections.deque(sorted(requests, key=lambda r: r.arrival_s))
    queue: collections.deque[Request] = collections.deque()
    running: list[_Running] = []
    steps: list[Step] = []
    clock = 0.0
    while pending or queue or running:
        while pending and pending[0].arrival_s <= clock:
            queue.append(pending.popleft())
        if not queue and not running:
            clock = pending[0].arrival_s
            continue
        budget = config.token_budget
        decoding = [r for r in running if r.prompt_left == 0][:budget]
        budget -= len(decoding)
        chunks: list[tuple[_Running, int]] = []
        for r in running:
            if r.prompt_left > 0 and budget > 0:
                take = min(r.prompt_left, budget)
                chunks.append((r, take))
                budget -= take
        while queue and budget > 0 and len(running) < config.max_running:
            req = queue.popleft()
            r = _Running(req.prompt_tokens, req.output_tokens)
            running.append(r)
            take = min(r.prompt_left, budget)
            chunks.append((r, take))
            budget -= take
        steps.append(Step(clock, len(decoding), sum(t for _, t in chunks), len(chunks)))
        for r in decoding:
            r.output_left -= 1
        for r, take in chunks:
            r.prompt_left -= take
            if r.prompt_left == 0:
                r.output_left -= 1  # the step that finishes the prompt samples the first token
        running = [r for r in running if r.output_left > 0]
        clock += config.step_seconds
    return steps


def _make_buckets(limit: int = 1 << 17) -> tuple[int, ...]:
    sizes = {1}
    p = 1
    while p <= limit:
        sizes.add(p)
        if p >= 2:
            sizes.add(p + p // 2)
        p *= 2
    return tuple(sorted(sizes))


BUCKETS = _make_buckets()  # 1, 2, 3, 4, 6, 8, 12, 16, 24, ...: two sizes per octave


def bucket_tokens(num_tokens: int) -> int:
    """The smallest bucket size >= num_tokens."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens: expected >= 1, got {num_tokens}")
    for size in BUCKETS:
        if size >= num_tokens:
            return size
    raise ValueError(f"num_tokens: expected <= {BUCKETS[-1]}, got {num_tokens}")


@dataclasses.dataclass(frozen=True)
class TraceStats:
    num_steps: int
    total_tokens: int
    decode_tokens: int
    prefill_tokens: int
    mean_step_tokens: float
    max_step_tokens: int
    buckets: tuple[int, ...]  # bucket sizes that occur
    duration_s: float  # simulated


def trace_stats(steps: Sequence[Step]) -> TraceStats:
    if not steps:
        raise ValueError("steps: expected at least one step")
    tokens = [s.num_tokens for s in steps]
    return TraceStats(
        len(steps),
        sum(tokens),
        sum(s.decode_tokens for s in steps),
        sum(s.prefill_tokens for s in steps),
        sum(tokens) / len(steps),
        max(tokens),
        tuple(sorted({bucket_tokens(t) for t in tokens})),
        steps[-1].time_s - steps[0].time_s,
    )


@dataclasses.dataclass(frozen=True)
class StepLatency:
    """Per-step MoE latency of one backend over the trace."""

    p50_us: float
    p90_us: float
    p99_us: float
    mean_us: float
    tokens_per_s: float
    time_over_floor: float  # sum of step latencies / sum of step floors


def step_latencies(
    steps: Sequence[Step],
    samples_by_bucket: Mapping[int, Sequence[float]],
    floor_us_by_bucket: Mapping[int, float],
    *,
    seed: int = 0,
) -> StepLatency:
    """Each step draws one timing sample of its bucket; percentiles over steps."""
    rng = np.random.default_rng(seed)
    latencies = np.empty(len(steps))
    floors = np.empty(len(steps))
    for n, step in enumerate(steps):
        bucket = bucket_tokens(step.num_tokens)
        samples = samples_by_bucket.get(bucket)
        if not samples:
            raise ValueError(f"samples_by_bucket: no samples for bucket {bucket}")
        latencies[n] = samples[int(rng.integers(len(samples)))]
        floors[n] = floor_us_by_bucket[bucket]
    total_s = float(latencies.sum()) * 1e-6
    tokens = sum(s.num_tokens for s in steps)
    return StepLatency(
        float(np.percentile(latencies, 50)),
        float(np.percentile(latencies, 90)),
        float(np.percentile(latencies, 99)),
        float(latencies.mean()),
        tokens / total_s if total_s > 0 else float("inf"),
        float(latencies.sum() / floors.sum()),
    )
