"""The benchmark loop: models x cases (T, routing distribution) x backends, each backend isolated.

For each model: weights are made once (one copy). Every case's inputs are made once and shared by all
backends: rotated (hidden, router logits) pairs, the routing of each (benchmark twin) for the floor, and
the fp32 reference rows of each pair. Then the backends are built (each may prepack) and run on every
case: correctness first, on every rotated pair (a wrong backend is reported and not timed), then the timing, after
which each rotation's timed graph replays once more and its output is checked again. A backend whose `applies`
declines a cell is reported unsupported there; a ceiling (BackendFamily.CEILING: not a layer) is not checked.

BackendOrder says how the backends share the card:
- SEQUENTIAL (default): one backend at a time over every case, freed before the next. Each backend's replays run
  back to back, in the card's steady state under that backend's own power draw (least memory; ratios between
  backends carry the drift of the minutes between them).
- INTERLEAVED: the model's backends are built together, and each case times all of them in the same rounds
  (timing.time_interleaved, a balanced Latin square of orders). Where the card cannot hold every backend's prepared
  weights at once, a build that runs out of memory closes the group: the backends built so far run every case, are
  freed, and the next group starts with that backend. Each result names the backends it was timed with. On a
  power-capped card a replay inherits the clock its predecessor left: measured on the H200 (stop 32), the full grid
  interleaved gave our layer 3% less time over the floor at prefill and torch._grouped_mm 8% more than the same
  code timed sequentially, while repeats of either order agree within 0.01. Use it for A/B ratios of backends with
  similar power draw (a tuned and an untuned layer); the sequential figure is the steady state a layer sees alone.

Isolation: any exception in a backend's build, check or timing is recorded for that case and the run goes
on. If the CUDA context itself is lost (a kernel fault is sticky), the remaining cases are marked as not
run with the reason, and the results so far are still returned.
"""
from __future__ import annotations

import dataclasses
import enum
import gc
import platform
import time
import zlib
from typing import Callable, Sequence

import numpy as np
import torch

from moe2cta.presets import ModelPreset

from .backends import BACKENDS, BackendFamily, CellFacts, ExpertWeights, make_expert_weights
from .correctness import AmbiguousRows, CheckStatus, ReferenceRows, check_output, make_reference
from .distributions import BenchRouter, LoadSummary, RoutingDistribution, make_router_logits, summarize_load
from .floors import TARGETS, Ceilings, moe_floor
from .routing_twin import route_twin
from .timing import TimingConfig, rotation_count, time_interleaved
from .trace import Step, StepLatency, TraceConfig, TraceStats, step_latencies, trace_stats

__all__ = [
    "BackendOrder",
    "CaseStatus",
    "CaseResult",
    "TraceResult",
    "RunConfig",
    "BenchResults",
    "run_benchmark",
    "environment",
    "summarize_backend",
]


class CaseStatus(enum.Enum):
    OK = "ok"
    WRONG = "wrong"  # failed the correctness check: not timed
    ERROR = "error"  # raised
    UNSUPPORTED = "unsupported"  # the backend says it cannot run this model
    UNAVAILABLE = "unavailable"  # the backend cannot run on this machine
    NOT_RUN = "not run"  # the CUDA context was lost earlier


class BackendOrder(enum.Enum):
    SEQUENTIAL = "sequential"  # one backend at a time over every case, freed before the next
    INTERLEAVED = "interleaved"  # a model's backends built together, each case timing them in the same rounds

    def describe(self) -> str:
        if self is BackendOrder.INTERLEAVED:
            return ("interleaved: every cell times its backends in the same rounds (balanced orders); no drift between "
                    "them, but each replay inherits the clock its predecessor's power draw left")
        return ("sequential: one backend at a time over every cell, each in its own power steady state (ratios between "
                "backends carry the drift of the minutes between them)")


@dataclasses.dataclass
class CaseResult:
    model: str
    distribution: str
    tokens: int
    backend: str
    family: str
    status: CaseStatus
    reason: str
    experts_hit: float
    floor_us: float
    floor_bound: str
    median_us: float | None = None
    p10_us: float | None = None
    p90_us: float | None = None
    p99_us: float | None = None
    mean_us: float | None = None
    timing_mode: str = ""
    timing_note: str = ""
    rel_err: float | None = None
    tolerance: float | None = None
    row_err: float | None = None  # the worst checked row's relative error (correctness.Verdict)
    row_tolerance: float | None = None
    samples_us: tuple[float, ...] = ()
    build_note: str = ""  # e.g. MoELayer.backend_reason: which backend AUTO chose and why
    timed_with: tuple[str, ...] = ()  # the backends timed in the same rounds (this one included)
    sm_mhz: float | None = None  # median SM clock while the samples ran (timing.ClockReading; shared by timed_with)
    power_w: float | None = None  # median board power over the same window (NVML's running average: lags it)
    # the floor of each rotated input's routing (floor_us is their mean); sample i ran rotation i % len
    rotation_floors_us: tuple[float, ...] = ()
    rotation_experts_hit: tuple[int, ...] = ()  # experts each rotation's routing hit (floors under other ceilings)
    first_rotation: int = 0  # sample i ran rotation (first_rotation + i) % len(rotation_floors_us)

    @property
    def ratio(self) -> float | None:
        """Time over the floor: the median over the samples of each sample's time over the floor of the routing it
        ran (the rotated inputs hit different experts at small T), else median_us / floor_us."""
        if self.median_us is None or not self.floor_us:
            return None
        floors = self.rotation_floors_us
        if self.samples_us and floors and all(f > 0 for f in floors):
            return float(np.median([t / floors[(self.first_rotation + i) % len(floors)]
                                    for i, t in enumerate(self.samples_us)]))
        return self.median_us / self.floor_us

    @property
    def target(self) -> float:
        return TARGETS.for_tokens(self.tokens)


@dataclasses.dataclass(frozen=True)
class TraceResult:
    model: str
    distribution: str
    backend: str
    status: CaseStatus
    reason: str
    latency: StepLatency | None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    models: tuple[ModelPreset, ...]
    sweep_tokens: tuple[int, ...]  # T of the decode / prefill sweeps (may be empty with a trace)
    distributions: tuple[RoutingDistribution, ...]
    backends: tuple[str, ...]
    device: torch.device
    ceilings: Ceilings
    timing: TimingConfig = TimingConfig()
    trace: TraceConfig | None = None
    seed: int = 0
    check_rows: int | None = None  # token rows checked against the fp32 reference; None: every row
    dtype: torch.dtype = torch.bfloat16  # weights and activations
    order: BackendOrder = BackendOrder.SEQUENTIAL
    router: BenchRouter = BenchRouter.MODEL  # models holds the presets with this router's RoutingConfig
    measured_ceilings: Ceilings | None = None  # this card's, measured at start (recorded; floors use `ceilings`)

    def __post_init__(self):
        if not self.models:
            raise ValueError("models: expected at least one model")
        if not self.distributions:
            raise ValueError("distributions: expected at least one routing distribution")
        if not self.backends:
            raise ValueError("backends: expected at least one backend")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"backends: unknown {unknown}, expected names from {sorted(BACKENDS)}")
        if not self.sweep_tokens and self.trace is None:
            raise ValueError("sweep_tokens: expected token counts, or a trace")
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype: expected bfloat16, float16 or float32, got {self.dtype}")
        if self.check_rows is not None and (isinstance(self.check_rows, bool) or not isinstance(self.check_rows, int)
                                            or self.check_rows < 1):
            raise ValueError(f"check_rows: expected an int >= 1 or None (every row), got {self.check_rows!r}")
        if any(t < 1 for t in self.sweep_tokens):
            raise ValueError(f"sweep_tokens: expected positive token counts, got {self.sweep_tokens}")
        if not isinstance(self.order, BackendOrder):
            raise TypeError(f"order: expected a BackendOrder, got {self.order!r}")
        if not isinstance(self.router, BenchRouter):
            raise TypeError(f"router: expected a BenchRouter, got {self.router!r}")
        object.__setattr__(self, "models", tuple(self.router.apply(p) for p in self.models))


@dataclasses.dataclass
class BenchResults:
    config: RunConfig
    environment: dict
    availability: dict[str, tuple[bool, str]]
    results: list[CaseResult]
    loads: dict[tuple[str, str, int], LoadSummary]  # (model, distribution, T) -> routing load of input 0
    trace_steps: list[Step] | None = None
    trace_stats: TraceStats | None = None
    trace_results: list[TraceResult] = dataclasses.field(default_factory=list)
    wall_seconds: float = 0.0

    def sweep_results(self) -> list[CaseResult]:
        sweep = set(self.config.sweep_tokens)
        return [r for r in self.results if r.tokens in sweep]


def environment(device: torch.device) -> dict:
    env = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    env["cpu_threads"] = torch.get_num_threads()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            capability=f"sm_{props.major}{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    else:
        env["gpu"] = "none (CPU run: times are CPU times; floors use the H200 default ceilings)"
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        pass
    return env


@dataclasses.dataclass
class _CaseData:
    tokens: int
    distribution: RoutingDistribution
    inputs: list[tuple[torch.Tensor, torch.Tensor]]
    experts_hit: float
    floor_us: float
    floor_bound: str
    load: LoadSummary
    references: tuple[ReferenceRows, ...]  # one per rotated input
    rotation_floors_us: tuple[float, ...]
    rotation_experts_hit: tuple[int, ...]


MAX_REDRAWS = 3  # other draws of a rotated input whose every checked row is ambiguous (_make_case)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def _make_case(preset, weights: ExpertWeights, tokens, dist, run: RunConfig) -> _CaseData:
    device = run.device
    elem = torch.finfo(run.dtype).bits // 8
    bytes_per_input = tokens * (preset.hidden * elem + preset.num_experts * 4)
    inputs, hits, floors, references = [], [], [], []
    for rot in range(rotation_count(bytes_per_input, run.timing)):
        for draw in range(MAX_REDRAWS + 1):
            # draw 0: the seed every run used; the next ones only where every checked row of a draw has an ambiguous
            # top-k (at T = 1: one near-tie), which no backend could be checked on
            seed = _seed(run.seed, preset.name, tokens, dist.label, rot, *(("redraw", draw) if draw else ()))
            gen = torch.Generator(device=device).manual_seed(seed)
            hidden = torch.randn(tokens, preset.hidden, generator=gen, device=device, dtype=run.dtype)
            logits = make_router_logits(dist, tokens, preset.num_experts, preset.routing, seed=seed, device=device)
            routed = route_twin(logits, preset.routing, weights.e_score_correction_bias)
            try:
                reference = make_reference(hidden, weights, routed, preset.activation, max_rows=run.check_rows)
                break
            except AmbiguousRows:
                if draw == MAX_REDRAWS:
                    raise
        load = summarize_load(routed.topk_ids, preset.num_experts)
        if rot == 0:
            first_load = load
        references.append(reference)
        hits.append(load.experts_hit)
        floors.append(moe_floor(preset, tokens, load.experts_hit, run.ceilings, elem_bytes=elem))
        inputs.append((hidden, logits))
    floor_us = float(np.mean([f.us for f in floors]))
    bound = floors[0].bound
    return _CaseData(tokens, dist, inputs, float(np.mean(hits)), floor_us, bound, first_load, tuple(references),
                     tuple(f.us for f in floors), tuple(int(h) for h in hits))


class _DeviceLost(RuntimeError):
    pass


def _cuda_alive(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return True
    except Exception:
        return False


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception:
            pass


def _poison_free_memory(nbytes: int, device: torch.device) -> None:
    """Fill that much of the caching allocator's memory with NaN and hand it back, so that an output allocated next
    likely holds NaN wherever a backend leaves it unwritten (not stale values of an earlier, correct output)."""
    if device.type == "cuda" and nbytes > 0:
        torch.full((-(-nbytes // 4),), float("nan"), dtype=torch.float32, device=device)


def _worst(verdicts):
    """The verdict of the rotation closest to failing: the larger of its error over its tolerance and its worst row's
    error over the row tolerance."""
    return max(verdicts, key=lambda v: v.margin_used)


def _check_fields(verdict) -> dict:
    """A verdict's errors and bounds as CaseResult fields (none for an unchecked backend)."""
    if verdict is None:
        return {}
    return dict(rel_err=verdict.rel_err, tolerance=verdict.tolerance, row_err=verdict.row_err,
                row_tolerance=verdict.row_tolerance)


def _check(fn, spec, preset, case: _CaseData, run: RunConfig, base: dict):
    """The first call on each rotated input against its fp32 reference: (None, the worst rotation's verdict) if all
    passed, else (CaseResult, None) for the first that did not. Each output is NaN-filled before it is freed, so that
    no later call's output can inherit its correct rows."""
    verdicts = []
    for rotation, args in enumerate(case.inputs):
        try:
            _poison_free_memory(2 * case.tokens * preset.hidden * torch.finfo(run.dtype).bits // 8, run.device)
            out = fn(*args)
            verdict = check_output(out, case.references[rotation], case.tokens, preset.hidden)
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                out.fill_(float("nan"))
            del out
        except Exception as exc:
            if not _cuda_alive(run.device):
                raise _DeviceLost(f"{spec.name} on {preset.name} T={case.tokens}: {_short(exc)}") from exc
            return CaseResult(**base, status=CaseStatus.ERROR,
                              reason=f"first call on rotated input {rotation} raised {_short(exc)}"), None
        if verdict.status is CheckStatus.FAIL:
            reason = verdict.reason if len(case.inputs) == 1 else f"rotated input {rotation}: {verdict.reason}"
            return CaseResult(**base, status=CaseStatus.WRONG, reason=reason, **_check_fields(verdict)), None
        verdicts.append(verdict)
    return None, _worst(verdicts)


def _run_cell(group: dict, preset, case: _CaseData, run: RunConfig, progress) -> list[CaseResult]:
    """Every backend of the group on one case: checks, then the passing ones timed in the same rounds.
    group: {name: (fn or None, status, reason, build note)}. Raises _DeviceLost (with the results so far attached)."""
    results: dict[str, CaseResult] = {}
    passed: dict[str, tuple] = {}  # name -> (fn, verdict, base)
    for name, (fn, status, reason, note) in group.items():
        spec = BACKENDS[name]
        progress(f"{preset.name} T={case.tokens} {case.distribution.label} {name}")
        base = _case_fields(preset, case, name, note)
        if fn is None:
            results[name] = CaseResult(**base, status=status, reason=reason)
            continue
        applies, why = spec.applies(preset, CellFacts(case.tokens, case.experts_hit, case.floor_bound))
        if not applies:
            results[name] = CaseResult(**base, status=CaseStatus.UNSUPPORTED, reason=why)
            continue
        if spec.family is BackendFamily.CEILING:  # a bound, not the layer: no check (backends.py)
            passed[name] = (fn, None, base)
            continue
        try:
            failed, verdict = _check(fn, spec, preset, case, run, base)
        except _DeviceLost as exc:
            results[name] = CaseResult(**base, status=CaseStatus.ERROR, reason=f"CUDA context lost: {exc}")
            for n in list(group)[list(group).index(name) + 1:]:
                progress(f"{preset.name} T={case.tokens} {case.distribution.label} {n}")
            exc.results = [results[n] if n in results else _lost_case(preset, case, n, group[n], str(exc))
                           for n in group]
            raise
        if failed is not None:
            results[name] = failed
        else:
            passed[name] = (fn, verdict, base)
    timings = {}
    if passed:
        checked = {n for n, p in passed.items() if p[1] is not None}  # (ceilings are not checked)

        def replay_check(name, rotation, output):
            if name not in checked:
                return None
            return check_output(output, case.references[rotation], case.tokens, preset.hidden)

        timings = time_interleaved({n: p[0] for n, p in passed.items()}, case.inputs, run.device, run.timing,
                                   {n: BACKENDS[n].graph_capture for n in passed}, check=replay_check)
    timed_with = tuple(passed)
    lost = None
    for name, (fn, verdict, base) in passed.items():
        timing = timings[name]
        if isinstance(timing, BaseException):
            if lost is None and not _cuda_alive(run.device):
                lost = f"{name} on {preset.name} T={case.tokens}: {_short(timing)}"
            results[name] = CaseResult(**base, status=CaseStatus.ERROR, reason=f"timing raised {_short(timing)}",
                                       **_check_fields(verdict), timed_with=timed_with)
            continue
        replays = [(r, v) for r, v in enumerate(timing.checks) if v is not None]  # what each timed graph computes
        wrong = next(((r, v) for r, v in replays if v.status is CheckStatus.FAIL), None)
        if wrong is not None:
            where = "" if len(case.inputs) == 1 else f" of rotated input {wrong[0]}"
            results[name] = CaseResult(**base, status=CaseStatus.WRONG, reason=f"timed graph replays{where}: "
                                       f"{wrong[1].reason}", **_check_fields(wrong[1]), timed_with=timed_with)
            continue
        results[name] = CaseResult(
            **base,
            status=CaseStatus.OK,
            reason="",
            median_us=timing.median_us,
            p10_us=timing.percentile(10),
            p90_us=timing.percentile(90),
            p99_us=timing.percentile(99),
            mean_us=timing.mean_us,
            timing_mode=timing.mode.value,
            timing_note=timing.note,
            **_check_fields(verdict),
            samples_us=timing.samples_us,
            first_rotation=timing.first_rotation,
            timed_with=timed_with,
            sm_mhz=None if timing.clock is None else timing.clock.sm_mhz,
            power_w=None if timing.clock is None else timing.clock.power_w,
        )
    ordered = [results[n] for n in group]
    if lost is not None:
        exc = _DeviceLost(lost)
        exc.results = ordered
        raise exc
    return ordered


def _all_cases(preset, run, token_list, status, reason, progress) -> list[CaseResult]:
    out = []
    for dist in run.distributions:
        for tokens in token_list:
            for name in run.backends:
                progress(f"{preset.name} T={tokens} {name}")
                out.append(_not_run(preset, dist, tokens, name, status, reason))
    return out


class _OutOfMemory(RuntimeError):
    pass


def _build(spec, preset, weights, available: tuple[bool, str], *, others_held: bool = False):
    """(callable or None, status, reason, build note); raises _DeviceLost, and _OutOfMemory where the device ran
    out of memory while other backends were held (others_held): the caller frees them and builds this one again."""
    ok, why = available
    if not ok:
        return None, CaseStatus.UNAVAILABLE, why, ""
    try:
        supported, why = spec.supports(preset, weights)
        if not supported:
            return None, CaseStatus.UNSUPPORTED, why, ""
        fn = spec.build(preset, weights)
    except torch.cuda.OutOfMemoryError as exc:
        if others_held:
            raise _OutOfMemory(_short(exc)) from None
        return None, CaseStatus.ERROR, f"build raised {_short(exc)}", ""
    except Exception as exc:
        if not _cuda_alive(weights.w13.device):
            raise _DeviceLost(f"{spec.name} build on {preset.name}: {_short(exc)}") from exc
        return None, CaseStatus.ERROR, f"build raised {_short(exc)}", ""
    return fn, CaseStatus.OK, "", str(getattr(fn, "backend_reason", ""))


def _build_group(pending: list, preset, weights, run: RunConfig, availability, lost):
    """Build the next group of backends (popped from `pending`): one under SEQUENTIAL, else as many as the device
    holds. Returns ({name: (fn or None, status, reason, note)}, lost)."""
    group = {}
    while pending and (run.order is BackendOrder.INTERLEAVED or not group):
        name = pending[0]
        if lost is not None:
            group[name] = (None, CaseStatus.NOT_RUN, f"not run: CUDA context lost ({lost})", "")
            pending.pop(0)
            continue
        try:
            group[name] = _build(BACKENDS[name], preset, weights, availability[name],
                                 others_held=any(fn is not None for fn, *_ in group.values()))
        except _OutOfMemory:
            _free(run.device)
            break  # the backends built so far run first; this one starts the next group
        except _DeviceLost as exc:
            lost = str(exc)
            group[name] = (None, CaseStatus.ERROR, f"CUDA context lost: {exc}", "")
        pending.pop(0)
    return group, lost


def _case_fields(preset, case: _CaseData, name: str, note: str) -> dict:
    """The CaseResult fields every result of (model, case, backend) shares, whatever its status."""
    return dict(model=preset.name, distribution=case.distribution.label, tokens=case.tokens, backend=name,
                family=BACKENDS[name].family.value, experts_hit=case.experts_hit, floor_us=case.floor_us,
                floor_bound=case.floor_bound, build_note=note, rotation_floors_us=case.rotation_floors_us,
                rotation_experts_hit=case.rotation_experts_hit)


def _lost_case(preset, case: _CaseData, name: str, built: tuple, lost: str) -> CaseResult:
    fn, status, reason, note = built
    if fn is not None or status is CaseStatus.OK:
        status, reason = CaseStatus.NOT_RUN, f"not run: CUDA context lost ({lost})"
    return CaseResult(**_case_fields(preset, case, name, note), status=status, reason=reason)


def run_benchmark(run: RunConfig, progress: Callable[[str], None] | None = None) -> BenchResults:
    """Run every (model, case, backend); `progress(label)` is called once per (model, case, backend)."""
    started = time.perf_counter()
    progress = progress or (lambda label: None)
    availability = {name: BACKENDS[name].availability(run.device) for name in run.backends}
    steps = stats = None
    if run.trace is not None:
        from .trace import generate_requests, schedule_steps

        steps = schedule_steps(generate_requests(run.trace), run.trace)
        stats = trace_stats(steps)
    token_list = sorted(set(run.sweep_tokens) | set(stats.buckets if stats else ()))
    results: list[CaseResult] = []
    loads: dict[tuple[str, str, int], LoadSummary] = {}
    lost: str | None = None  # why the CUDA context is gone, once it is
    for preset in run.models:
        if lost is not None:
            results += _all_cases(preset, run, token_list, CaseStatus.NOT_RUN, f"not run: CUDA context lost ({lost})", progress)
            continue
        cases: list[_CaseData] = []
        try:
            weights = make_expert_weights(preset, run.device, seed=_seed(run.seed, preset.name, "weights"), dtype=run.dtype)
            for dist in run.distributions:
                for tokens in token_list:
                    case = _make_case(preset, weights, tokens, dist, run)
                    loads[(preset.name, dist.label, tokens)] = case.load
                    cases.append(case)
        except Exception as exc:
            reason = f"preparing {preset.name} failed: {_short(exc)}"
            if not _cuda_alive(run.device):
                lost = reason
            results += _all_cases(preset, run, token_list, CaseStatus.ERROR, reason, progress)
            cases = weights = None
            _free(run.device)
            continue
        pending = list(run.backends)
        while pending:
            group, lost = _build_group(pending, preset, weights, run, availability, lost)
            for case in cases:
                if lost is not None:
                    for name in group:
                        progress(f"{preset.name} T={case.tokens} {case.distribution.label} {name}")
                    results += [_lost_case(preset, case, name, group[name], lost) for name in group]
                    continue
                try:
                    results += _run_cell(group, preset, case, run, progress)
                except _DeviceLost as exc:
                    lost = str(exc)
                    results += exc.results
                _free(run.device)
            group = None
            _free(run.device)
        cases = weights = None
        _free(run.device)
    bench = BenchResults(run, environment(run.device), availability, results, loads, steps, stats)
    if steps is not None:
        bench.trace_results = _trace_results(bench)
    bench.wall_seconds = time.perf_counter() - started
    return bench


def _not_run(preset, dist, tokens, name, status, reason) -> CaseResult:
    spec = BACKENDS[name]
    return CaseResult(preset.name, dist.label, tokens, name, spec.family.value, status, reason, float("nan"),
                      float("nan"), "")


def _trace_results(bench: BenchResults) -> list[TraceResult]:
    run = bench.config
    steps = bench.trace_steps
    by_key = {(r.model, r.distribution, r.backend, r.tokens): r for r in bench.results}
    out = []
    for preset in run.models:
        for dist in run.distributions:
            for name in run.backends:
                samples, floors, bad = {}, {}, None
                for bucket in bench.trace_stats.buckets:
                    r = by_key.get((preset.name, dist.label, name, bucket))
                    if r is None or r.status is not CaseStatus.OK:
                        bad = r
                        break
                    samples[bucket] = r.samples_us
                    floors[bucket] = r.floor_us
                if bad is not None or not samples:
                    status = bad.status if bad is not None else CaseStatus.NOT_RUN
                    reason = f"T={bad.tokens}: {bad.reason}" if bad is not None else "no measurements"
                    out.append(TraceResult(preset.name, dist.label, name, status, reason, None))
                    continue
                latency = step_latencies(steps, samples, floors, seed=run.seed)
                out.append(TraceResult(preset.name, dist.label, name, CaseStatus.OK, "", latency))
    return out


def summarize_backend(results: Sequence[CaseResult]) -> dict:
    """Geomean time/floor over OK cells: decode (T<=512), prefill (T>=2048), all; worst cell; target check."""
    from .floors import Phase, phase_of

    ok = [r for r in results if r.status is CaseStatus.OK and r.ratio is not None and r.ratio > 0]

    def geomean(rs):
        return float(np.exp(np.mean([np.log(r.ratio) for r in rs]))) if rs else None

    decode = [r for r in ok if phase_of(r.tokens) is Phase.DECODE]
    prefill = [r for r in ok if phase_of(r.tokens) is Phase.PREFILL]
    worst = max(ok, key=lambda r: r.ratio) if ok else None
    summary = {
        "cells_ok": len(ok),
        "cells": len(results),
        "geomean_decode": geomean(decode),
        "geomean_prefill": geomean(prefill),
        "geomean_all": geomean(ok),
        "worst": worst.ratio if worst else None,
        "worst_cell": f"{worst.model} T={worst.tokens} {worst.distribution}" if worst else None,
    }
    if ok:
        summary["meets_targets"] = bool(
            all(r.ratio <= r.target for r in ok) and summary["worst"] <= TARGETS.worst and len(ok) == len(results)
        )
    return summary

