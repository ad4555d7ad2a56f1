"""Optional autotuning of grouped GEMM configurations, bucketed by tokens per expert, cached in one file.

Serving never tunes at start-up: `layer_configs` / `select_config` return a cached measurement when there
is one and the planner's heuristic (moe2cta/planner.py) otherwise, with the kernel family's config object,
so nothing here needs a GPU unless `autotune` is called.

Buckets. Kernels are compiled against a symbolic M, so a configuration only has to suit a range of batch
sizes: the key is the bucket of tokens per expert (rows / experts hit, rounded up to a power of two,
1 .. 65536), never the exact M. `autotune` measures one representative problem per bucket: every expert
holding `bucket` rows.

Cache file (JSON, small, human-readable; written atomically):
    {"format": "moe2cta-tuning", "version": 1,
     "entries": {"<gpu>|<dtype>|E<E>|N<N>|K<K>|<epilogue>|b<bucket>":
                 {"key": {...}, "candidate": {...Candidate fields...}, "seconds": 1.2e-05,
                  "tried": 8, "heuristic_seconds": 1.4e-05, "created": "2026-11-29T12:00:00Z"}}}
Location: the `path` argument, else env MOE2CTA_TUNING_CACHE (read when called, never at import), else
~/.cache/moe2cta/tuning.json.

Rules: `autotune` refuses to run while a CUDA graph is being captured (call it before capture); it times
candidates through a caller-supplied runner (candidate, problem) -> zero-argument callable, so the kernel
families stay out of this module; a candidate whose runner raises is skipped and reported.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import pathlib
import statistics
import tempfile
from typing import Callable, Iterable

from .grouped_gemm.budget import Arch, WorkUnit
from .grouped_gemm import epilogue
from .grouped_gemm.epilogue import Activation, GemmStage
from . import planner

__all__ = [
    "MAX_BUCKET",
    "BUCKETS",
    "TUNE_BUCKETS",
    "token_bucket",
    "TuningKey",
    "TuningEntry",
    "TuningCache",
    "default_cache_path",
    "bucket_problem",
    "autotune",
    "select_config",
    "epilogue_name",
    "layer_configs",
    "cuda_event_timer",
    "cute_runner",
    "candidate_from_dict",
]

FORMAT = "moe2cta-tuning"
VERSION = 1
MAX_BUCKET = 65536
BUCKETS = tuple(2**i for i in range(17))  # 1 .. 65536 rows per expert
TUNE_BUCKETS = tuple(b for b in BUCKETS if b <= 4096)  # autotune's default: larger buckets keep the heuristic


def token_bucket(tokens_per_expert: float) -> int:
    """Power of two >= tokens_per_expert, clamped to 1 .. MAX_BUCKET (0 and fractions go to 1)."""
    if isinstance(tokens_per_expert, bool) or not isinstance(tokens_per_expert, (int, float)):
        raise TypeError(f"tokens_per_expert: expected a number, got {tokens_per_expert!r}")
    if tokens_per_expert < 0 or math.isnan(tokens_per_expert):
        raise ValueError(f"tokens_per_expert: expected >= 0, got {tokens_per_expert!r}")
    if tokens_per_expert <= 1:
        return 1
    return min(MAX_BUCKET, 1 << math.ceil(math.log2(tokens_per_expert)))


@dataclasses.dataclass(frozen=True)
class TuningKey:
    """Static facts a tuned configuration depends on; never the exact token count."""

    gpu: str  # torch.cuda.get_device_name(), e.g. "NVIDIA H200"
    dtype: str  # "bfloat16" / "float16"
    num_experts: int
    n: int
    k: int
    epilogue: str  # e.g. "swiglu", "swiglu_oai", "gelu_gated" (GEMM1) or "row_scale" / "plain" (GEMM2)
    bucket: int

    def __post_init__(self):
        for name in ("gpu", "dtype", "epilogue"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or "|" in value:
                raise ValueError(f"{name}: expected a non-empty string without '|', got {value!r}")
        for name in ("num_experts", "n", "k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if self.bucket not in BUCKETS:
            raise ValueError(f"bucket: expected a power of two in 1..{MAX_BUCKET} (see token_bucket), got {self.bucket!r}")

    def to_str(self) -> str:
        return f"{self.gpu}|{self.dtype}|E{self.num_experts}|N{self.n}|K{self.k}|{self.epilogue}|b{self.bucket}"

    def with_bucket(self, bucket: int) -> "TuningKey":
        return dataclasses.replace(self, bucket=bucket)


def candidate_from_dict(d: dict) -> planner.Candidate:
    """Inverse of Candidate.to_dict (ignores derived fields such as cluster)."""
    try:
        return planner.Candidate(
            arch=Arch.parse(d["arch"]),
            unit=WorkUnit(d["unit"]),
            block_m=int(d["block_m"]),
            block_n=int(d["block_n"]),
            block_k=int(d["block_k"]),
            stages=int(d["stages"]),
            accumulator_slots=int(d.get("accumulator_slots", 2)),
            pair_threshold=int(d.get("pair_threshold", 0)),
            epi_n=int(d.get("epi_n", 32)),
            epi_buffers=int(d.get("epi_buffers", 2)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"candidate: malformed entry {d!r}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class TuningEntry:
    key: TuningKey
    candidate: planner.Candidate
    seconds: float
    tried: int = 0
    heuristic_seconds: float | None = None
    created: str = ""

    def to_json(self) -> dict:
        return {
            "key": dataclasses.asdict(self.key),
            "candidate": self.candidate.to_dict(),
            "seconds": self.seconds,
            "tried": self.tried,
            "heuristic_seconds": self.heuristic_seconds,
            "created": self.created,
        }

    @classmethod
    def from_json(cls, d: dict) -> "TuningEntry":
        try:
            key = TuningKey(**d["key"])
            return cls(key, candidate_from_dict(d["candidate"]), float(d["seconds"]), int(d.get("tried", 0)),
                       d.get("heuristic_seconds"), str(d.get("created", "")))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"entry: malformed {d!r}: {exc}") from None


def default_cache_path(path: str | os.PathLike | None = None) -> pathlib.Path:
    """`path`, else env MOE2CTA_TUNING_CACHE (read now), else ~/.cache/moe2cta/tuning.json."""
    if path is not None:
        return pathlib.Path(path)
    env = os.environ.get("MOE2CTA_TUNING_CACHE")
    if env:
        return pathlib.Path(env)
    return pathlib.Path.home() / ".cache" / "moe2cta" / "tuning.json"


class TuningCache:
    """The whole tuning file in memory; `save()` writes it back atomically."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = default_cache_path(path)
        self.entries: dict[str, TuningEntry] = {}
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"tuning cache {self.path}: unreadable ({exc}); delete it or pass another path") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"tuning cache {self.path}: not a {FORMAT} file")
        if data.get("version") != VERSION:
            raise ValueError(f"tuning cache {self.path}: version {data.get('version')!r}, expected {VERSION}")
        for key_str, entry in data.get("entries", {}).items():
            parsed = TuningEntry.from_json(entry)
            if parsed.key.to_str() != key_str:
                raise ValueError(f"tuning cache {self.path}: entry {key_str!r} holds key {parsed.key.to_str()!r}")
            self.entries[key_str] = parsed

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: TuningKey) -> TuningEntry | None:
        return self.entries.get(key.to_str())

    def put(self, entry: TuningEntry) -> None:
        self.entries[entry.key.to_str()] = entry

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "entries": {k: e.to_json() for k, e in sorted(self.entries.items())},
        }

    def save(self) -> pathlib.Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=1)
                f.write("\n")
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return self.path


def bucket_problem(kind: planner.GemmKind, num_experts: int, n: int, k: int, bucket: int,
                   experts_hit: int | None = None, **fields) -> planner.GemmProblem:
    """The representative problem of a bucket: `bucket` rows on each hit expert (default: all of them).

    fields: further GemmProblem fields (dtype, activation, has_bias, has_row_scale).
    """
    hit = num_experts if experts_hit is None else experts_hit
    if not 1 <= hit <= num_experts:
        raise ValueError(f"experts_hit: expected 1..{num_experts}, got {experts_hit!r}")
    counts = tuple(bucket if e < hit else 0 for e in range(num_experts))
    return planner.GemmProblem(f"{kind.value}-b{bucket}", kind, n, k, counts,
                               f"bucket: {bucket} rows on each of {hit} of {num_experts} experts", **fields)


def _check_not_capturing() -> None:
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("autotune: a CUDA graph is being captured; tune before capture (or use select_config)")


def cuda_event_timer(fn: Callable[[], None], warmup: int = 3, repeats: int = 20) -> float:
    """Median seconds of fn() by CUDA events (GPU only)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("cuda_event_timer: no CUDA device; pass a timer for CPU tests")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def _family_entry_points(arch: Arch):
    """(grouped_gemm1, grouped_gemm2, prepack_w13) of the CuTe family of `arch` (imported on use)."""
    from .grouped_gemm import sm90_grouped_gemm

    if arch is Arch.SM90:
        return sm90_grouped_gemm.sm90_grouped_gemm1, sm90_grouped_gemm.sm90_grouped_gemm2, sm90_grouped_gemm.prepack_w13
    from .grouped_gemm import sm100_grouped_gemm

    return sm100_grouped_gemm.sm100_grouped_gemm1, sm100_grouped_gemm.sm100_grouped_gemm2, sm90_grouped_gemm.prepack_w13


def cute_runner(device: str = "cuda", seed: int = 0):
    """A runner for `autotune` over the CuTe families: random inputs in the padded layout of docs/design.md.

    runner(candidate, problem) builds A [rows, K] (rows per expert padded to max(128, block_m)), the
    weights (made once per shape, reused by every candidate and bucket; GEMM1 prepacked), counts and
    row offsets, and returns a callable running the family's grouped GEMM with the candidate's config.
    Written for the GPU and only checked on the CPU with stand-in kernels (no device time was used).
    """
    import torch

    weights: dict = {}

    def runner(candidate: planner.Candidate, problem: planner.GemmProblem) -> Callable[[], None]:
        config = planner.to_kernel_config(candidate, problem)
        if config is None:
            raise RuntimeError(f"cute_runner: no {candidate.arch.value} kernel family in this build")
        gemm1, gemm2, prepack = _family_entry_points(candidate.arch)
        dtype = getattr(torch, problem.dtype)
        gen = torch.Generator(device=device).manual_seed(seed)
        align = max(128, candidate.block_m)
        counts = torch.tensor(problem.counts, dtype=torch.int32)
        row_offsets = torch.zeros(problem.num_experts + 1, dtype=torch.int32)
        row_offsets[1:] = torch.cumsum((counts + align - 1) // align * align, 0)
        rows = max(int(row_offsets[-1]), align)
        a = torch.randn(rows, problem.k, device=device, dtype=dtype, generator=gen)
        wkey = (problem.kind, problem.num_experts, problem.n, problem.k, problem.dtype)
        if wkey not in weights:
            w = torch.randn(problem.num_experts, problem.n, problem.k, device=device, dtype=dtype, generator=gen)
            w.mul_(problem.k ** -0.5)
            weights[wkey] = prepack(w) if problem.kind is planner.GemmKind.GEMM1 else w
        w = weights[wkey]
        out = torch.empty(rows, problem.out_columns, device=device, dtype=dtype)
        offsets, counts = row_offsets.to(device), counts.to(device)
        if problem.kind is planner.GemmKind.GEMM1:
            activation = problem.activation or Activation.SWIGLU
            return lambda: gemm1(a, w, offsets, counts, activation, out=out, config=config)
        scale = torch.rand(rows, device=device, generator=gen) if problem.has_row_scale else None
        return lambda: gemm2(a, w, offsets, counts, row_scale=scale, out=out, config=config)

    return runner


def autotune(
    key: TuningKey,
    kind: planner.GemmKind,
    arch: Arch | str,
    runner: Callable[[planner.Candidate, planner.GemmProblem], Callable[[], None]],
    *,
    buckets: Iterable[int] | None = None,
    top: int = 8,
    timer: Callable[[Callable[[], None]], float] | None = None,
    cache: TuningCache | None = None,
    save: bool = True,
    hardware: planner.Hardware | None = None,
    log: Callable[[str], None] | None = None,
    **fields,
) -> dict[int, TuningEntry]:
    """Measure the planner's `top` candidates per bucket and store the fastest in the cache.

    key: the static facts (its bucket field is replaced per bucket); buckets default to TUNE_BUCKETS (up to
    4096 rows per expert: the representative problem of larger ones is too big to time cheaply).
    runner(candidate, problem) prepares inputs and returns a callable that runs the kernel once (e.g.
    cute_runner()); timer(fn) returns seconds (default: CUDA events). fields: further GemmProblem fields
    (activation, has_bias, has_row_scale); the dtype comes from the key. The heuristic's first choice is
    always among those timed, so tuning never does worse than the model on the measured problem.
    Returns {bucket: entry}.
    """
    _check_not_capturing()
    arch = Arch.parse(arch)
    if not isinstance(kind, planner.GemmKind):
        raise TypeError(f"kind: expected a planner.GemmKind, got {kind!r}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top: expected an int >= 1, got {top!r}")
    timer = timer or cuda_event_timer
    cache = cache if cache is not None else TuningCache()
    results: dict[int, TuningEntry] = {}
    for bucket in (TUNE_BUCKETS if buckets is None else tuple(buckets)):
        bkey = key.with_bucket(bucket)
        problem = bucket_problem(kind, key.num_experts, key.n, key.k, bucket, dtype=key.dtype, **fields)
        result = planner.search(problem, arch, hardware)
        if not result.ranked:
            if log:
                log(f"{bkey.to_str()}: no candidate fits, skipped")
            continue
        shapes = planner.best_per_shape(result.ranked)[:top]
        best: tuple[float, planner.Candidate] | None = None
        heuristic_seconds = None
        for i, ev in enumerate(shapes):
            try:
                fn = runner(ev.candidate, problem)
                seconds = float(timer(fn))
            except Exception as exc:  # a candidate that fails to build or run is skipped, not fatal
                if log:
                    log(f"{bkey.to_str()}: {ev.candidate.label()} failed: {type(exc).__name__}: {exc}")
                continue
            if i == 0:
                heuristic_seconds = seconds
            if log:
                log(f"{bkey.to_str()}: {ev.candidate.label()} {seconds * 1e6:.1f} us "
                    f"(model {ev.prediction.seconds * 1e6:.1f} us)")
            if best is None or seconds < best[0]:
                best = (seconds, ev.candidate)
        if best is None:
            continue
        created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        entry = TuningEntry(bkey, best[1], best[0], len(shapes), heuristic_seconds, created)
        cache.put(entry)
        results[bucket] = entry
    if save and results:
        cache.save()
    return results


def select_config(
    key: TuningKey,
    kind: planner.GemmKind,
    arch: Arch | str,
    *,
    cache: TuningCache | None = None,
    hardware: planner.Hardware | None = None,
    **fields,
) -> tuple[planner.Candidate, str]:
    """(candidate, source) for a key whose bucket came from token_bucket(rows / experts hit).

    source is "tuned" (from the cache) or "heuristic" (the planner's choice for the bucket's problem).
    Cheap and GPU-free; call it outside CUDA-graph capture and keep the result per bucket. fields: further
    GemmProblem fields for the heuristic's problem (dtype, activation, has_bias, has_row_scale).
    """
    if cache is not None:
        entry = cache.get(key)
        if entry is not None:
            return entry.candidate, "tuned"
    problem = bucket_problem(kind, key.num_experts, key.n, key.k, key.bucket, **fields)
    return planner.search(problem, arch, hardware).chosen.candidate, "heuristic"


def epilogue_name(kind: planner.GemmKind, activation=None, has_bias: bool = False, has_row_scale: bool = False) -> str:
    """The cache key's epilogue: 'swiglu', 'swiglu_oai_bias', 'plain_rowscale', ... (epilogue.epilogue_name).

    GEMM1 defaults to SwiGLU and never has a row scale; DENSE is named like GEMM2.
    """
    gated = kind is planner.GemmKind.GEMM1
    stage = GemmStage.GEMM1 if gated else GemmStage.GEMM2
    return epilogue.epilogue_name(stage, activation or Activation.SWIGLU, has_row_scale and not gated, has_bias)


def layer_configs(
    arch: Arch | str,
    *,
    hidden: int,
    intermediate: int,
    num_experts: int,
    tokens_per_expert: float,
    activation=None,
    has_bias: bool = False,
    dtype: str = "bfloat16",
    gpu: str | None = None,
    cache: TuningCache | None = None,
    hardware: planner.Hardware | None = None,
) -> dict[str, tuple[planner.Evaluation, str]]:
    """{"gemm1": (evaluation, source), "gemm2": ...} for one MoE layer at a tokens-per-expert load.

    The configuration comes from the cache when it holds the bucket (source "tuned"), else from the
    planner (source "heuristic"); evaluation.kernel_config is the kernel family's config object (None while
    that family is absent). GPU-free and cheap: call it once per bucket, outside CUDA-graph capture, and keep
    the result. gpu: the cache key's GPU name (default: the planner's hardware name for `arch`).
    """
    arch = Arch.parse(arch)
    hw = hardware or planner.HARDWARE[arch]
    bucket = token_bucket(tokens_per_expert)
    shapes = (
        (planner.GemmKind.GEMM1, 2 * intermediate, hidden, dict(activation=activation, has_bias=has_bias)),
        (planner.GemmKind.GEMM2, hidden, intermediate, dict(has_bias=has_bias, has_row_scale=True)),
    )
    out = {}
    for kind, n, k, fields in shapes:
        key = TuningKey(gpu or hw.name, dtype, num_experts, n, k, epilogue_name(kind, **fields), bucket)
        problem = bucket_problem(kind, num_experts, n, k, bucket, dtype=dtype, **fields)
        fields["dtype"] = dtype
        candidate, source = select_config(key, kind, arch, cache=cache, hardware=hw, **fields)
        evaluation = planner.evaluate(candidate, problem, hw)
        if not evaluation.ok:  # a stale cache entry the current kernels reject: fall back to the heuristic
            rejected = evaluation.reason
            candidate, _ = select_config(key, kind, arch, cache=None, hardware=hw, **fields)
            evaluation = planner.evaluate(candidate, problem, hw)
            source = f"heuristic (cached {key.to_str()} rejected: {rejected})"
        out[kind.value] = (evaluation, source)
    return out

