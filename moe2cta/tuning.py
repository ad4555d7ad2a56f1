"""Optional autotuning of grouped GEMM configurations, bucketed by tokens per expert, cached in one file.

Serving never tunes at start-up: `layer_configs` / `select_config` return a cached measurement when there
is one and the planner's heuristic (moe2cta/planner.py) otherwise, with the kernel family's config object,
so nothing here needs a GPU unless `autotune` is called.

Buckets. Kernels are compiled against a symbolic M, so a configuration only has to suit a range of batch
sizes: the key is the bucket of tokens per expert (rows / experts hit, rounded up to a power of two,
1 .. 65536), never the exact M. `autotune` measures one representative problem per bucket: every expert
holding `bucket` rows (BucketRows.EQUAL), or the same rows spread as uniform routing spreads them
(BucketRows.ROUTED: the partial last row blocks and padding rows of a real batch).

Cache file (JSON, small, human-readable; written atomically):
    {"format": "moe2cta-tuning", "version": 1,
     "entries": {"<gpu>|<dtype>|E<E>|N<N>|K<K>|<epilogue>|b<bucket>":
                 {"key": {...}, "candidate": {...Candidate fields...}, "seconds": 1.2e-05,
                  "tried": 8, "heuristic_seconds": 1.4e-05, "created": "2026-11-29T12:00:00Z",
                  "rows": "equal"}}}  (rows: the BucketRows timed on; entries without it were timed on "equal")
Location: the `path` argument, else env MOE2CTA_TUNING_CACHE (read when called, never at import), else
~/.cache/moe2cta/tuning.json.

Rules: `autotune` refuses to run while a CUDA graph is being captured (call it before capture); it times
candidates through a caller-supplied runner (candidate, problem) -> zero-argument callable, so the kernel
families stay out of this module; a candidate whose runner raises is skipped and reported, and with a
`check` a candidate whose output is wrong is reported and never cached. The candidates timed per bucket are
`candidates_to_time`: the family default (what the layer runs untuned) and the planner's top shapes; the
`moe2cta tune` command (moe2cta/tune_cli.py) compiles exactly those ahead of time and times them on the GPU.

Layer lookup: `kernel_configs_for_layer` maps a batch (num_tokens, top_k) to its bucket and returns the
kernel family's config objects from the cache, or None ("use the family default"); host-only and memoized.
"""
from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import json
import math
import os
import pathlib
import statistics
import tempfile
from typing import Callable, Iterable

from .capture import capture_cuda_graph
from .grouped_gemm.budget import Arch, WorkUnit
from .grouped_gemm import epilogue
from .grouped_gemm.epilogue import Activation, GemmStage
from . import planner
from .config import _parse_enum

__all__ = [
    "MAX_BUCKET",
    "BUCKETS",
    "TUNE_BUCKETS",
    "token_bucket",
    "TuningKey",
    "TuningEntry",
    "TuningCache",
    "default_cache_path",
    "BucketRows",
    "bucket_problem",
    "autotune",
    "select_config",
    "epilogue_name",
    "layer_configs",
    "cuda_event_timer",
    "cute_runner",
    "CuteRunner",
    "candidate_from_dict",
    "Trial",
    "family_default_candidate",
    "candidates_to_time",
    "batched_event_timer",
    "layer_bucket",
    "kernel_configs_for_layer",
]

FORMAT = "moe2cta-tuning"
VERSION = 1
MAX_BUCKET = 65536
BUCKETS = tuple(2**i for i in range(17))  # 1 .. 65536 rows per expert
TUNE_BUCKETS = tuple(b for b in BUCKETS if b <= 4096)  # autotune's default: larger buckets keep the heuristic


class BucketRows(enum.Enum):
    """How a bucket's representative problem spreads its rows over the experts it hits."""

    # every hit expert holds exactly `bucket` rows: where bucket is a multiple of the kernels' row block no expert
    # ends in a partial block, so no padding rows are multiplied
    EQUAL = "equal"
    # the same bucket * hit rows, each on a uniformly drawn hit expert (seeded): the spread of counts, and so the
    # partial last blocks and padding rows, that a batch under uniform top-k routing has (its variance up to a
    # factor (E - k) / (E - 1), which distinct top-k picks take off)
    ROUTED = "routed"

    @classmethod
    def parse(cls, value: "BucketRows | str") -> "BucketRows":
        return _parse_enum(cls, value, "rows")


def token_bucket(tokens_per_expert: float) -> int:
    """Power of two >= tokens_per_expert, clamped to 1 .. MAX_BUCKET (0 and fractions go to 1)."""
    if isinstance(tokens_per_expert, bool) or not isinstance(tokens_per_expert, (int, float)):
        raise TypeError(f"tokens_per_expert: expected a number, got {tokens_per_expert!r}")
    if not 0 <= tokens_per_expert < math.inf:  # also NaN
        raise ValueError(f"tokens_per_expert: expected a finite number >= 0, got {tokens_per_expert!r}")
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
    rows: str = BucketRows.EQUAL.value  # the BucketRows the candidates were timed on

    def to_json(self) -> dict:
        return {
            "key": dataclasses.asdict(self.key),
            "candidate": self.candidate.to_dict(),
            "seconds": self.seconds,
            "tried": self.tried,
            "heuristic_seconds": self.heuristic_seconds,
            "created": self.created,
            "rows": self.rows,
        }

    @classmethod
    def from_json(cls, d: dict) -> "TuningEntry":
        try:
            key = TuningKey(**d["key"])
            return cls(key, candidate_from_dict(d["candidate"]), float(d["seconds"]), int(d.get("tried", 0)),
                       d.get("heuristic_seconds"), str(d.get("created", "")),
                       BucketRows.parse(d.get("rows", BucketRows.EQUAL.value)).value)
        except (KeyError, TypeError, AttributeError) as exc:
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
    """The whole tuning file in memory; `save()` writes it back atomically, merged over what the file holds by then
    (entries another process saved meanwhile are kept; this cache's win where both hold a key)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = default_cache_path(path)
        self.entries: dict[str, TuningEntry] = {}
        self._put_keys: set[str] = set()  # the keys put() since the load: what save() writes over the file's
        self.version = 0  # bumped by put(): memoized lookups (kernel_configs_for_layer) see the change
        self._layer_memo: dict = {}
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        self.entries.update(self._read_entries())

    def _read_entries(self) -> dict[str, TuningEntry]:
        """The entries of the file at self.path, checked (ValueError naming the file and the entry otherwise)."""
        try:
            data = json.loads(self.path.read_bytes().decode("utf-8"))
        except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError and UnicodeDecodeError
            raise ValueError(f"tuning cache {self.path}: unreadable ({exc}); delete it or pass another path") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"tuning cache {self.path}: not a {FORMAT} file")
        if data.get("version") != VERSION:
            raise ValueError(f"tuning cache {self.path}: version {data.get('version')!r}, expected {VERSION}")
        entries = data.get("entries", {})
        parsed_entries = {}
        if not isinstance(entries, dict):
            raise ValueError(f"tuning cache {self.path}: 'entries' is a {type(entries).__name__}, expected an object "
                             "of key -> entry")
        for key_str, entry in entries.items():
            try:
                if not isinstance(entry, dict):
                    raise ValueError(f"expected an object, got {type(entry).__name__}")
                parsed = TuningEntry.from_json(entry)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"tuning cache {self.path}: entry {key_str!r}: {exc}") from None
            if parsed.key.to_str() != key_str:
                raise ValueError(f"tuning cache {self.path}: entry {key_str!r} holds key {parsed.key.to_str()!r}")
            parsed_entries[key_str] = parsed
        return parsed_entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: TuningKey) -> TuningEntry | None:
        return self.entries.get(key.to_str())

    def put(self, entry: TuningEntry) -> None:
        self.entries[entry.key.to_str()] = entry
        self._put_keys.add(entry.key.to_str())
        self.version += 1

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "entries": {k: e.to_json() for k, e in sorted(self.entries.items())},
        }

    def save(self) -> pathlib.Path:
        """Write the file: under an exclusive lock (`<path>.lock`), the file's entries as they are now, with this
        cache's put() entries over them, replace it atomically (mode 0644, or the old file's). Two tuning runs that
        share a file keep each other's entries; afterwards this cache holds the merged set."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(self.path) + ".lock", "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            merged = self._read_entries() if self.path.exists() else {}
            merged.update({key: self.entries[key] for key in self._put_keys})
            for key, entry in self.entries.items():  # loaded here and not in the file any more: kept
                merged.setdefault(key, entry)
            self.entries = merged
            self.version += 1  # entries another process saved are new here: memoized lookups see them
            mode = self.path.stat().st_mode & 0o777 if self.path.exists() else 0o644
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(self.to_json(), f, indent=1)
                    f.write("\n")
                os.chmod(tmp, mode)
                os.replace(tmp, self.path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        return self.path


def bucket_problem(kind: planner.GemmKind, num_experts: int, n: int, k: int, bucket: int,
                   experts_hit: int | None = None, rows: BucketRows | str = BucketRows.EQUAL, seed: int = 0,
                   **fields) -> planner.GemmProblem:
    """The representative problem of a bucket: `bucket` rows per hit expert (default: all of them hit), spread by
    `rows` (BucketRows; ROUTED draws them with `seed`, so a bucket's problem is the same every run). The total, and
    so the mean rows per expert the kernel choice depends on, is bucket * hit either way.

    fields: further GemmProblem fields (dtype, activation, has_bias, has_row_scale).
    """
    rows = BucketRows.parse(rows)
    if bucket not in BUCKETS:
        raise ValueError(f"bucket: expected a power of two in 1..{MAX_BUCKET} (see token_bucket), got {bucket!r}")
    hit = num_experts if experts_hit is None else experts_hit
    if not 1 <= hit <= num_experts:
        raise ValueError(f"experts_hit: expected 1..{num_experts}, got {experts_hit!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int, got {seed!r}")
    if rows is BucketRows.EQUAL:
        counts = tuple(bucket if e < hit else 0 for e in range(num_experts))
        return planner.GemmProblem(f"{kind.value}-b{bucket}", kind, n, k, counts,
                                   f"bucket: {bucket} rows on each of {hit} of {num_experts} experts", **fields)
    import torch

    gen = torch.Generator().manual_seed(seed)
    drawn = torch.bincount(torch.randint(hit, (bucket * hit,), generator=gen), minlength=hit).tolist()
    counts = tuple(drawn) + (0,) * (num_experts - hit)
    return planner.GemmProblem(f"{kind.value}-b{bucket}-routed", kind, n, k, counts,
                               f"bucket: {bucket * hit} rows routed uniformly over {hit} of {num_experts} experts "
                               f"({min(drawn)}..{max(drawn)} per expert, seed {seed})", **fields)


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


def batched_event_timer(fn: Callable[[], None], warmup: int = 2, samples: int = 5, target_seconds: float = 3e-4,
                        max_batch: int = 20, graph: bool = True) -> float:
    """Median seconds per fn() by CUDA events over batches of back-to-back calls (GPU only; cheap for tuning).

    The batch is sized so it lasts about target_seconds (at most max_batch calls). With `graph` the batch is
    captured once in a CUDA graph and replayed, so host overhead (Python wrappers, launch) is not measured
    as kernel time (small decode kernels would all look alike otherwise) -- the way serving runs them; if
    capture fails, eager batches are timed instead.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("batched_event_timer: no CUDA device; pass a timer for CPU tests")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) * 1e-3, 1e-7)
    batch = max(1, min(max_batch, round(target_seconds / once)))
    run_batch = None
    if graph:
        try:
            cuda_graph = torch.cuda.CUDAGraph()
            with capture_cuda_graph(cuda_graph, stream=stream):
                for _ in range(batch):
                    fn()
            run_batch = cuda_graph.replay
            run_batch()
            torch.cuda.synchronize()
        except Exception:  # not capturable: time eager batches
            torch.cuda.synchronize()
            run_batch = None
    if run_batch is None:
        def run_batch():
            for _ in range(batch):
                fn()
    times = []
    for _ in range(samples):
        start.record()
        run_batch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / batch)
    return statistics.median(times)


def _family_entry_points(arch: Arch):
    """(grouped_gemm1, grouped_gemm2, prepack_w13) of the CuTe family of `arch` (imported on use)."""
    from .grouped_gemm import sm90_grouped_gemm

    if arch is Arch.SM90:
        return sm90_grouped_gemm.sm90_grouped_gemm1, sm90_grouped_gemm.sm90_grouped_gemm2, sm90_grouped_gemm.prepack_w13
    from .grouped_gemm import sm100_grouped_gemm

    return sm100_grouped_gemm.sm100_grouped_gemm1, sm100_grouped_gemm.sm100_grouped_gemm2, sm90_grouped_gemm.prepack_w13


def sm90_problem(problem: planner.GemmProblem):
    """The sm90 family's Sm90Problem of a planner problem (GEMM1: SwiGLU unless given; GEMM2: no activation)."""
    import torch

    from .grouped_gemm import sm90_grouped_gemm as s90

    gated = problem.kind is planner.GemmKind.GEMM1
    return s90.Sm90Problem(GemmStage.GEMM1 if gated else GemmStage.GEMM2, problem.n, problem.k, problem.num_experts,
                           getattr(torch, problem.dtype), (problem.activation or Activation.SWIGLU) if gated else None,
                           problem.has_bias, problem.has_row_scale and not gated)


def family_default_candidate(problem: planner.GemmProblem, arch: Arch | str) -> planner.Candidate | None:
    """The family's default_config (what the layer runs with config=None) as a planner Candidate.

    Same compiled kernel (kernel_key) as the default: its stage count is the one the default resolves to.
    None for families without such a mapping here (sm_100a: not yet).
    """
    arch = Arch.parse(arch)
    if arch is not Arch.SM90:
        return None
    from .grouped_gemm import sm90_grouped_gemm as s90

    config = s90.default_config(sm90_problem(problem))
    return planner.make_candidate(arch, config.work_unit, config.tile_m * config.cluster_m, config.tile_n,
                                  config.tile_k, s90.resolve_stages(config))


def candidates_to_time(problem: planner.GemmProblem, arch: Arch | str, top: int, *, baseline: bool = True,
                       hardware: planner.Hardware | None = None) -> list[tuple[str, planner.Candidate]]:
    """[(role, candidate)] that autotune times for one bucket, in order: the family default (role "default",
    when `baseline`), then the planner's best candidate of each of its `top` best shapes ("planner 1", ...).

    A candidate that appears twice is timed once, its roles joined ("default = planner 2"). `moe2cta tune
    build` compiles exactly these kernels, so the bundle and the run agree.
    """
    arch = Arch.parse(arch)
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top: expected an int >= 1, got {top!r}")
    result = planner.search(problem, arch, hardware)
    out: list[list] = []
    default = family_default_candidate(problem, arch) if baseline else None
    if default is not None:
        out.append(["default", default])
    for i, ev in enumerate(planner.best_per_shape(result.ranked)[:top], 1):
        for item in out:
            if item[1] == ev.candidate:
                item[0] += f" = planner {i}"
                break
        else:
            out.append([f"planner {i}", ev.candidate])
    return [(role, cand) for role, cand in out]


class CuteRunner:
    """A runner for `autotune` over the CuTe families, with an output check against the torch twin.

    For each problem (the bucket's representative one) it builds once: A [rows, K] in the padded layout of
    docs/design.md (rows per expert rounded up to `align`: the layer's dispatch alignment, 128 in MoELayer
    and in `moe2cta tune`; None: max(128, block_m) of each candidate, one layout per tile height),
    random weights scaled by K^-1/2 (made once per shape; GEMM1 also prepacked), counts, row offsets and,
    on the first check, the fp32 twin's output (grouped_gemm/reference.py). Only the latest problem's
    tensors are kept. runner(candidate, problem) returns a callable running the family's grouped GEMM with
    the candidate's config, kernels from `kernel_directory` (else $MOE2CTA_KERNEL_DIR, else JIT).
    check(candidate, problem, fn) -> (ok, detail): output rows first set to NaN, one run, then every
    valid row within 4x the bf16/fp16 rounding error of the twin (the error of an ideal same-dtype run),
    at least 1e-3 of the largest output.
    """

    def __init__(self, device: str = "cuda", seed: int = 0, align: int | None = None, kernel_directory=None):
        if align is not None and (isinstance(align, bool) or not isinstance(align, int) or align < 128 or align % 128):
            raise ValueError(f"align: expected None or a multiple of 128 (the kernels' row blocks), got {align!r}")
        self.device, self.seed, self.align, self.kernel_directory = device, seed, align, kernel_directory
        self._weights: dict = {}
        self._inputs: tuple | None = None  # ((problem, align), tensors dict) of the latest problem

    def _weights_for(self, problem: planner.GemmProblem):
        import torch

        wkey = (problem.kind, problem.num_experts, problem.n, problem.k, problem.dtype, problem.has_bias)
        if wkey not in self._weights:
            gen = torch.Generator(device=self.device).manual_seed(self.seed + 1)
            dtype = getattr(torch, problem.dtype)
            w = torch.randn(problem.num_experts, problem.n, problem.k, device=self.device, dtype=dtype, generator=gen)
            w.mul_(problem.k ** -0.5)
            bias = (torch.randn(problem.num_experts, problem.n, device=self.device, generator=gen) * 0.1
                    if problem.has_bias else None)
            _, _, prepack = _family_entry_points(Arch.SM90)
            packed = prepack(w) if problem.kind is planner.GemmKind.GEMM1 else w
            self._weights = {wkey: (w, packed, bias)}  # one shape at a time: the weights can be large
        return self._weights[wkey]

    def _align_for(self, candidate: planner.Candidate | None) -> int:
        if self.align is not None:
            return self.align
        return max(128, candidate.block_m) if candidate is not None else 128

    def inputs(self, problem: planner.GemmProblem, candidate: planner.Candidate | None = None) -> dict:
        """The tensors of `problem` in the layout `candidate` runs on (all candidates alike when align is set)."""
        import torch

        align = self._align_for(candidate)
        if self._inputs is not None and self._inputs[0] == (problem, align):
            return self._inputs[1]
        self._inputs = None
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        dtype = getattr(torch, problem.dtype)
        counts = torch.tensor(problem.counts, dtype=torch.int32)
        row_offsets = torch.zeros(problem.num_experts + 1, dtype=torch.int32)
        row_offsets[1:] = torch.cumsum((counts + align - 1) // align * align, 0)
        rows = max(int(row_offsets[-1]), align)
        w, packed, bias = self._weights_for(problem)
        tensors = {
            "a": torch.randn(rows, problem.k, device=self.device, dtype=dtype, generator=gen),
            "w": w, "packed": packed, "bias": bias,
            "row_offsets": row_offsets.to(self.device), "counts": counts.to(self.device),
            "out": torch.empty(rows, problem.out_columns, device=self.device, dtype=dtype),
            "row_scale": (torch.rand(rows, device=self.device, generator=gen) + 0.5) if problem.has_row_scale else None,
            "reference": None,
        }
        self._inputs = ((problem, align), tensors)
        return tensors

    def __call__(self, candidate: planner.Candidate, problem: planner.GemmProblem) -> Callable[[], None]:
        config = planner.to_kernel_config(candidate, problem)
        if config is None:
            raise RuntimeError(f"cute_runner: no {candidate.arch.value} kernel family in this build")
        gemm1, gemm2, _ = _family_entry_points(candidate.arch)
        t = self.inputs(problem, candidate)
        extra = {} if self.kernel_directory is None else {"kernel_directory": self.kernel_directory}
        if problem.kind is planner.GemmKind.GEMM1:
            activation = problem.activation or Activation.SWIGLU
            if t["bias"] is not None:
                extra["b13"] = t["bias"]
            return lambda: gemm1(t["a"], t["packed"], t["row_offsets"], t["counts"], activation, out=t["out"],
                                 config=config, **extra)
        if t["bias"] is not None:
            extra["b2"] = t["bias"]
        return lambda: gemm2(t["a"], t["w"], t["row_offsets"], t["counts"], row_scale=t["row_scale"], out=t["out"],
                             config=config, **extra)

    def reference(self, problem: planner.GemmProblem, candidate: planner.Candidate | None = None):
        """The fp32 twin's output for the problem's inputs, [valid rows, out_columns] (computed once)."""
        import torch

        from .grouped_gemm import reference as twin

        t = self.inputs(problem, candidate)
        if t["reference"] is None:
            ref = torch.zeros(t["out"].shape, dtype=torch.float32, device=self.device)
            if problem.kind is planner.GemmKind.GEMM1:
                twin.grouped_gemm1_reference(t["a"], t["w"], t["row_offsets"], t["counts"],
                                             problem.activation or Activation.SWIGLU, b13=t["bias"], out=ref)
            else:
                twin.grouped_gemm2_reference(t["a"], t["w"], t["row_offsets"], t["counts"], row_scale=t["row_scale"],
                                             b2=t["bias"], out=ref)
            t["reference"] = ref[self._valid_rows(t)]
        return t["reference"]

    @staticmethod
    def _valid_rows(t: dict):
        """Row indices of the valid (non-padding) rows, made once per inputs."""
        import torch

        if t.get("valid_rows") is None:
            starts, counts = t["row_offsets"][:-1].tolist(), t["counts"].tolist()
            index = [torch.arange(s, s + c) for s, c in zip(starts, counts) if c > 0]
            device = t["out"].device
            t["valid_rows"] = torch.cat(index).to(device) if index else torch.zeros(0, dtype=torch.long, device=device)
        return t["valid_rows"]

    def check(self, candidate: planner.Candidate, problem: planner.GemmProblem, fn: Callable[[], None]) -> tuple[bool, str]:
        import torch

        t = self.inputs(problem, candidate)
        ref = self.reference(problem, candidate)
        t["out"].fill_(float("nan"))
        fn()
        got = t["out"][self._valid_rows(t)].float()
        if not bool(torch.isfinite(got).all()):
            return False, "non-finite or unwritten output rows"
        if t.get("tolerance") is None:  # once per inputs: the twin's own rounding error to the output dtype
            rounding = float((ref.to(getattr(torch, problem.dtype)).float() - ref).abs().max()) if ref.numel() else 0.0
            scale = float(ref.abs().max()) if ref.numel() else 0.0
            t["tolerance"] = (max(4 * rounding, 1e-3 * scale), scale)
        tol, scale = t["tolerance"]
        err = float((got - ref).abs().max()) if ref.numel() else 0.0
        if err > tol:
            return False, f"max error {err:.3g} > tolerance {tol:.3g} (largest output {scale:.3g})"
        return True, f"max error {err:.3g} <= {tol:.3g}"


def cute_runner(device: str = "cuda", seed: int = 0, align: int | None = None, kernel_directory=None) -> CuteRunner:
    """A CuteRunner (see there): runner(candidate, problem) -> callable, plus .check for autotune(check=...)."""
    return CuteRunner(device, seed, align, kernel_directory)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One candidate of one bucket as autotune saw it. status: "ok", "wrong" (check failed) or "failed"."""

    bucket: int
    role: str  # "default", "planner 1", "default = planner 2", ...
    candidate: planner.Candidate
    status: str
    seconds: float | None = None
    detail: str = ""
    model_seconds: float | None = None


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
    check: Callable[[planner.Candidate, planner.GemmProblem, Callable[[], None]], tuple[bool, str]] | None = None,
    baseline: bool = True,
    trials: list | None = None,
    rows: BucketRows | str = BucketRows.EQUAL,
    **fields,
) -> dict[int, TuningEntry]:
    """Measure the candidates of each bucket (candidates_to_time) and store the fastest in the cache.

    key: the static facts (its bucket field is replaced per bucket); buckets default to TUNE_BUCKETS (up to
    4096 rows per expert: the representative problem of larger ones is too big to time cheaply).
    runner(candidate, problem) prepares inputs and returns a callable that runs the kernel once (e.g.
    cute_runner()); timer(fn) returns seconds (default: CUDA events). check(candidate, problem, fn) ->
    (ok, detail) runs the kernel once and compares it with a reference before it is timed: a wrong
    candidate is reported (log, trials) and never cached. baseline: also time the family default (what the
    layer runs untuned). trials: a list that receives one Trial per candidate. rows (BucketRows): how the timed
    problem spreads its rows; the candidates are always chosen on the EQUAL problem (the same mean rows per expert,
    so the same kernels: a bundle from `moe2cta tune build` serves both). fields: further GemmProblem
    fields (activation, has_bias, has_row_scale); the dtype comes from the key. The heuristic's first choice
    is always among those timed, so tuning never does worse than the model on the measured problem.
    Returns {bucket: entry}; entry.heuristic_seconds is the planner's first choice's time.
    """
    _check_not_capturing()
    arch = Arch.parse(arch)
    if not isinstance(kind, planner.GemmKind):
        raise TypeError(f"kind: expected a planner.GemmKind, got {kind!r}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top: expected an int >= 1, got {top!r}")
    rows = BucketRows.parse(rows)
    timer = timer or cuda_event_timer
    cache = cache if cache is not None else TuningCache()
    hw = hardware or planner.HARDWARE[arch]
    results: dict[int, TuningEntry] = {}
    for bucket in (TUNE_BUCKETS if buckets is None else tuple(buckets)):
        bkey = key.with_bucket(bucket)
        planned = bucket_problem(kind, key.num_experts, key.n, key.k, bucket, dtype=key.dtype, **fields)
        problem = planned if rows is BucketRows.EQUAL else bucket_problem(
            kind, key.num_experts, key.n, key.k, bucket, rows=rows, dtype=key.dtype, **fields)
        chosen = candidates_to_time(planned, arch, top, baseline=baseline, hardware=hw)
        if not chosen:
            if log:
                log(f"{bkey.to_str()}: no candidate fits, skipped")
            continue
        best: tuple[float, planner.Candidate] | None = None
        heuristic_seconds = None
        for role, candidate in chosen:
            ev = planner.evaluate(candidate, problem, hw)
            model = ev.prediction.seconds if ev.ok else None
            seconds, status, detail = None, "ok", ""
            try:
                fn = runner(candidate, problem)
                if check is not None:
                    good, detail = check(candidate, problem, fn)
                    status = "ok" if good else "wrong"
                if status == "ok":
                    seconds = float(timer(fn))
            except Exception as exc:  # a candidate that fails to build or run is skipped, not fatal
                status, detail = "failed", f"{type(exc).__name__}: {exc}"
            if trials is not None:
                trials.append(Trial(bucket, role, candidate, status, seconds, detail, model))
            if log:
                what = f"{seconds * 1e6:.1f} us" if seconds is not None else f"{status.upper()}: {detail}"
                model_text = f" (model {model * 1e6:.1f} us)" if model is not None else ""
                log(f"{bkey.to_str()}: [{role}] {candidate.label()} {what}{model_text}")
            if seconds is None:
                continue
            if "planner 1" in role.split(" = "):
                heuristic_seconds = seconds
            if best is None or seconds < best[0]:
                best = (seconds, candidate)
        if best is None:
            continue
        created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        entry = TuningEntry(bkey, best[1], best[0], len(chosen), heuristic_seconds, created, rows.value)
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
    arch = Arch.parse(arch)
    if cache is not None:
        entry = cache.get(key)
        if entry is not None and entry.candidate.arch is arch:  # another family's entry: the heuristic instead
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



def layer_bucket(num_tokens: int, top_k: int, num_experts: int) -> int:
    """The bucket of one MoE forward: token_bucket(rows / experts hit), rows = num_tokens * top_k, experts hit
    as expected under uniform routing (planner.expected_experts_hit; at most E, at most the rows)."""
    for name, value in (("num_tokens", num_tokens), ("top_k", top_k), ("num_experts", num_experts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "num_tokens" else 1):
            raise ValueError(f"{name}: expected an int >= {0 if name == 'num_tokens' else 1}, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k: expected at most num_experts ({num_experts}), got {top_k}")
    if num_tokens == 0:
        return 1
    hit = planner.expected_experts_hit(num_tokens, top_k, num_experts)
    return token_bucket(num_tokens * top_k / hit)


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def _current_gpu_name(arch: Arch) -> str:
    """The current CUDA device's name (what `moe2cta tune run` keys entries by), else the planner's for arch."""
    try:
        import torch
    except ImportError:
        return planner.HARDWARE[arch].name
    if torch.cuda.is_available():
        return _device_name(torch.cuda.current_device())
    return planner.HARDWARE[arch].name


def _dtype_text(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in ("bfloat16", "float16"):
        raise ValueError(f"dtype: expected bfloat16 or float16 (torch dtype or name), got {dtype!r}")
    return name


def kernel_configs_for_layer(
    arch: Arch | str,
    hidden: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    num_tokens: int,
    activation=None,
    has_bias: bool = False,
    dtype="bfloat16",
    cache: TuningCache | None = None,
    *,
    gemm2_row_scale: bool = True,
    gpu: str | None = None,
) -> tuple[object | None, object | None, str]:
    """(gemm1_config, gemm2_config, source) for the CuTe path of one MoE forward of num_tokens tokens.

    A config is the kernel family's object (Sm90GemmConfig / Sm100GemmConfig) when the cache holds this
    layer's bucket (layer_bucket) for that GEMM, else None: "use the family default" (config=None). A cached
    entry the current kernels reject (a stale file) also gives None. gemm2_row_scale: GEMM2 scales rows by
    the router weights (router weight on the output, the default; `moe2cta tune` tunes that epilogue only,
    so with False GEMM2 stays on the default unless such entries exist: its kernel may not be bundled). source: "tuned (bucket B)", "default (...)"
    with the reason, or "gemm1 ...; gemm2 ..." when the two differ. Host-only, no GPU work, no sync:
    memoized on the cache object, so after the first call per bucket it is a dict lookup. gpu: the cache
    key's GPU name (default: the current CUDA device's name, else the planner's name for arch).
    """
    arch = Arch.parse(arch)
    for name, value in (("hidden", hidden), ("intermediate", intermediate)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    bucket = layer_bucket(num_tokens, top_k, num_experts)
    if cache is None:
        return None, None, "default (no tuning cache)"
    if not isinstance(cache, TuningCache):
        raise TypeError(f"cache: expected a TuningCache or None, got {type(cache).__name__}")
    dtype_name = _dtype_text(dtype)
    activation = Activation.parse(activation) if activation is not None else Activation.SWIGLU
    gpu = gpu or _current_gpu_name(arch)
    memo_key = (arch, hidden, intermediate, num_experts, bucket, activation, bool(has_bias), dtype_name, gpu,
                bool(gemm2_row_scale))
    memo = cache._layer_memo
    if memo_key in memo and memo[memo_key][0] == cache.version:
        return memo[memo_key][1]
    shapes = (
        (planner.GemmKind.GEMM1, 2 * intermediate, hidden, dict(activation=activation, has_bias=bool(has_bias))),
        (planner.GemmKind.GEMM2, hidden, intermediate, dict(has_bias=bool(has_bias), has_row_scale=bool(gemm2_row_scale))),
    )
    configs, sources = [], []
    for kind, n, k, fields in shapes:
        key = TuningKey(gpu, dtype_name, num_experts, n, k, epilogue_name(kind, **fields), bucket)
        entry = cache.get(key)
        if entry is None:
            configs.append(None)
            sources.append(f"default (bucket {bucket} not tuned)")
            continue
        if entry.candidate.arch is not arch:  # a hand-edited or merged file: another family's configuration
            configs.append(None)
            sources.append(f"default (cached {key.to_str()} is a {entry.candidate.arch.value} configuration, "
                           f"expected {arch.value})")
            continue
        problem = bucket_problem(kind, num_experts, n, k, bucket, dtype=dtype_name, **fields)
        try:
            config = planner.to_kernel_config(entry.candidate, problem)
        except ValueError as exc:
            configs.append(None)
            sources.append(f"default (cached {key.to_str()} rejected: {exc})")
            continue
        configs.append(config)
        sources.append(f"tuned (bucket {bucket})" if config is not None else "default (no kernel family here)")
    source = sources[0] if sources[0] == sources[1] else f"gemm1 {sources[0]}; gemm2 {sources[1]}"
    result = (configs[0], configs[1], source)
    memo[memo_key] = (cache.version, result)
    return result
