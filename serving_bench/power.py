"""Board power and SM clock while one CUDA graph replays back to back: is a kernel power-bound?

    sampler = PowerSampler(device_index=0)          # NVML through ctypes, else `nvidia-smi --query-gpu` per sample
    reading = sustain(graph, calls_per_replay=4, seconds=2.5, sampler=sampler)
    reading.power_w, reading.sm_mhz, reading.ms_per_call, reading.reasons

At the sizes of a prefill GEMM the H200 runs under its power limit: its SM clock drops until the board draws what
the limit allows. Two kernels that reach the same board power at different speeds differ in energy per operation,
and only a lower energy per useful operation (fewer padding MMAs, fewer bytes moved) makes such a kernel faster.
`sustain` replays one graph for a fixed time, discards the first `settle_s` (the board's power reading is a
running average and the clock needs a moment to settle), and reports the medians of the samples taken after it,
with the throttle reasons seen in them and the time per call measured over the same window.

The CLI (`--probes idle read copy matmul`) reads the card at rest, SM-fed DRAM streams and the floor's matmul; with
`--stream-pj-per-byte` it also fits an EnergyModel and prints each preset's prefill bound against the floor.

Reads only: nothing here sets clocks or limits. Needs a CUDA GPU and the driver's NVML library (or nvidia-smi).
"""
from __future__ import annotations

import dataclasses
import datetime
import enum
import shutil
import statistics
import subprocess
import sys
import threading
import time

__all__ = ["ClockEventReason", "EnergyModel", "PowerReading", "PowerSample", "PowerSampler", "Probe", "StreamKind",
           "idle_reading", "main", "matmul_reading", "parse_smi_line", "prefill_bounds", "stream_joules_per_byte",
           "stream_reading", "summarize", "sustain"]


class ClockEventReason(enum.IntFlag):
    """NVML's clocks event (throttle) reason bits that matter for a sustained kernel."""

    GPU_IDLE = 0x1
    APPLICATIONS_CLOCKS_SETTING = 0x2
    SW_POWER_CAP = 0x4
    HW_SLOWDOWN = 0x8
    SYNC_BOOST = 0x10
    SW_THERMAL_SLOWDOWN = 0x20
    HW_THERMAL_SLOWDOWN = 0x40
    HW_POWER_BRAKE_SLOWDOWN = 0x80
    DISPLAY_CLOCK_SETTING = 0x100


@dataclasses.dataclass(frozen=True)
class PowerSample:
    t: float  # host time.time() of the sample (nvidia-smi: its own timestamp, local time)
    power_w: float
    sm_mhz: float
    reasons: int  # ClockEventReason bits
    temperature_c: float


@dataclasses.dataclass(frozen=True)
class PowerReading:
    """Medians over the settled part of one sustained replay."""

    ms_per_call: float
    power_w: float
    sm_mhz: float
    temperature_c: float
    power_limit_w: float | None
    reasons: tuple[str, ...]  # the ClockEventReason names set in at least half the samples
    samples: int

    def joules_per_call(self) -> float:
        return self.power_w * self.ms_per_call * 1e-3

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"joules_per_call": self.joules_per_call()}


def parse_smi_line(line: str) -> PowerSample | None:
    """One line of `nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks_event_reasons.active,
    temperature.gpu --format=csv,noheader,nounits` (None for a line that is not such a sample, e.g. '[N/A]'
    fields). The timestamp is nvidia-smi's own (local time), so samples keep their times when its output reaches
    the pipe in bursts."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 5:
        return None
    try:
        t = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        power, clock, temp = float(fields[1]), float(fields[2]), float(fields[4])
        reasons = int(fields[3], 16) if fields[3].lower().startswith("0x") else int(fields[3])
    except ValueError:
        return None
    return PowerSample(t, power, clock, reasons, temp)


class _Nvml:
    """The few NVML calls the sampler needs, through ctypes on the driver's libnvidia-ml.so.1 (present wherever
    nvidia-smi works; no Python package needed)."""

    CLOCK_SM = 1
    TEMPERATURE_GPU = 0

    def __init__(self, device_index: int):
        import ctypes

        self._ct = ctypes
        self._lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self._lib.nvmlInit_v2(), "nvmlInit_v2")
        self._handle = ctypes.c_void_p()
        self._check(self._lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(device_index), ctypes.byref(self._handle)),
                    "nvmlDeviceGetHandleByIndex_v2")
        self._reasons = getattr(self._lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            self._lib.nvmlDeviceGetCurrentClocksThrottleReasons

    @staticmethod
    def _check(status: int, name: str) -> None:
        if status != 0:
            raise OSError(f"{name}: NVML error {status}")

    def _uint(self, fn, *args) -> int:
        value = self._ct.c_uint()
        self._check(fn(self._handle, *args, self._ct.byref(value)), fn.__name__)
        return value.value

    def sample(self) -> PowerSample:
        reasons = self._ct.c_ulonglong()
        self._check(self._reasons(self._handle, self._ct.byref(reasons)), "clock event reasons")
        return PowerSample(time.time(), self._uint(self._lib.nvmlDeviceGetPowerUsage) / 1000.0,
                           float(self._uint(self._lib.nvmlDeviceGetClockInfo, self._ct.c_int(self.CLOCK_SM))),
                           int(reasons.value),
                           float(self._uint(self._lib.nvmlDeviceGetTemperature, self._ct.c_int(self.TEMPERATURE_GPU))))

    def power_limit_w(self) -> float:
        return self._uint(self._lib.nvmlDeviceGetEnforcedPowerLimit) / 1000.0


class PowerSampler:
    """Samples board power, SM clock, clock event reasons and temperature of one GPU every `period_s` in a
    background thread between start() and stop(). Backend: NVML through ctypes where the driver's library
    loads, else one `nvidia-smi --query-gpu` call per sample (slower: tens of ms each); `available()` says
    whether either exists. device_index is NVML's (the CUDA index where CUDA_VISIBLE_DEVICES does not reorder)."""

    def __init__(self, device_index: int = 0, period_s: float = 0.02):
        if not isinstance(device_index, int) or device_index < 0:
            raise ValueError(f"device_index: expected a non-negative int, got {device_index!r}")
        if not period_s > 0:
            raise ValueError(f"period_s: expected a positive number of seconds, got {period_s!r}")
        self.device_index = device_index
        self.period_s = period_s
        self.samples: list[PowerSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None
        try:
            self._nvml: _Nvml | None = _Nvml(device_index)
        except (OSError, AttributeError):  # no driver library here, or no such device
            self._nvml = None

    def available(self) -> bool:
        return self._nvml is not None or shutil.which("nvidia-smi") is not None

    def backend(self) -> str:
        return "nvml" if self._nvml is not None else "nvidia-smi"

    def power_limit_w(self) -> float | None:
        if self._nvml is not None:
            return self._nvml.power_limit_w()
        if shutil.which("nvidia-smi") is None:
            return None
        out = subprocess.run(["nvidia-smi", "-i", str(self.device_index), "--query-gpu=power.limit",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True)
        try:
            return float(out.stdout.strip().splitlines()[0])
        except (ValueError, IndexError):
            return None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("PowerSampler.start: already sampling")
        if not self.available():
            raise RuntimeError("PowerSampler.start: neither NVML nor nvidia-smi is available")
        self.samples = []
        self._error = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> list[PowerSample]:
        """The samples since start(); a read that failed in the sampling thread is raised here."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = None
        if self._error is not None:
            raise RuntimeError(f"PowerSampler: reading the {self.backend()} failed: {self._error}") from self._error
        return list(self.samples)

    def sample(self) -> PowerSample | None:
        """One reading now (None where nvidia-smi gave no parsable line)."""
        return self._nvml.sample() if self._nvml is not None else self._smi_sample()

    def _smi_sample(self) -> PowerSample | None:
        for field in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
            out = subprocess.run(["nvidia-smi", "-i", str(self.device_index),
                                  f"--query-gpu=timestamp,power.draw,clocks.sm,{field},temperature.gpu",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True)
            sample = parse_smi_line(out.stdout.strip()) if out.returncode == 0 else None
            if sample is not None:
                return sample
        return None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                sample = self.sample()
                if sample is not None:
                    self.samples.append(sample)
                self._stop.wait(self.period_s)
        except OSError as exc:  # an NVML call failed: stop() reports it instead of an empty window
            self._error = exc


def summarize(samples: list[PowerSample], t_from: float, t_to: float, ms_per_call: float,
              power_limit_w: float | None) -> PowerReading:
    """The medians of the samples taken in [t_from, t_to], and the reasons set in at least half of them."""
    window = [s for s in samples if t_from <= s.t <= t_to]
    if not window:
        raise RuntimeError(f"summarize: no power sample in the {t_to - t_from:.2f} s window")
    counts = {flag: sum(1 for s in window if s.reasons & flag) for flag in ClockEventReason}
    reasons = tuple(flag.name for flag, n in counts.items() if 2 * n >= len(window))
    return PowerReading(ms_per_call, statistics.median(s.power_w for s in window),
                        statistics.median(s.sm_mhz for s in window),
                        statistics.median(s.temperature_c for s in window), power_limit_w, reasons, len(window))


def sustain(graph, calls_per_replay: int, seconds: float, sampler: PowerSampler, settle_s: float = 1.0,
            power_limit_w: float | None = None) -> PowerReading:
    """Replay `graph` (a torch.cuda.CUDAGraph of `calls_per_replay` calls) back to back for `seconds`, sampling
    power from the start; the reading covers the replays after the first `settle_s` seconds."""
    import torch

    if not seconds > settle_s >= 0:
        raise ValueError(f"seconds: expected more than settle_s ({settle_s}), got {seconds!r}")
    if not isinstance(calls_per_replay, int) or calls_per_replay < 1:
        raise ValueError(f"calls_per_replay: expected a positive int, got {calls_per_replay!r}")
    sampler.start()
    try:
        t0 = time.time()
        while time.time() - t0 < settle_s:  # settle: replay without timing
            graph.replay()
            torch.cuda.synchronize()
        t1 = time.time()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replays = 0
        start.record()
        while time.time() - t1 < seconds - settle_s:
            for _ in range(4):  # a few replays in flight between host checks keep the GPU busy
                graph.replay()
            replays += 4
            if replays % 16 == 0:
                torch.cuda.synchronize()
        end.record()
        end.synchronize()
        t2 = time.time()
    finally:
        time.sleep(2 * sampler.period_s)  # the samples of the last replays
        samples = sampler.stop()
    ms_per_call = start.elapsed_time(end) / (replays * calls_per_replay)
    return summarize(samples, t1, t2, ms_per_call, power_limit_w)


def matmul_reading(size: int = 8192, seconds: float = 3.0, copies: int = 4) -> tuple[float, PowerReading]:
    """(TFLOP/s, reading) of the floor's own ceiling, a size^3 bf16 matmul on random data (serving_bench/floors.py
    times it for a few ms at the start of a run), replayed back to back for `seconds`: the rate the card holds at
    its power limit, beside the rate of a short burst."""
    import torch

    if not isinstance(size, int) or size < 256:
        raise ValueError(f"size: expected an int >= 256, got {size!r}")
    if not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies: expected a positive int, got {copies!r}")
    a = [torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(size, size, device="cuda", dtype=torch.bfloat16)
    reading = _sustain_calls(lambda c: torch.mm(a[c], b, out=out), copies, seconds)
    return 2.0 * size**3 / (reading.ms_per_call * 1e-3) / 1e12, reading


def _sustain_calls(call, calls: int, seconds: float) -> PowerReading:
    """sustain() over one CUDA graph of call(0), ..., call(calls - 1) (the benches' capture_graph)."""
    import torch

    from moe2cta.serving_bench.hopper_gemm_bench import capture_graph

    sampler = PowerSampler(torch.cuda.current_device())
    return sustain(capture_graph(call, calls), calls, seconds, sampler, power_limit_w=sampler.power_limit_w())


class StreamKind(enum.Enum):
    """A DRAM stream to read power beside: what one replayed call does with its buffer."""

    COPY = "copy"  # dst.copy_(src): bytes read + written, the convention of the floor's copy bandwidth
    READ = "read"  # a sum of the buffer into fp32: bytes read, as a GEMM streams its weights


def stream_reading(kind: StreamKind, buffer_bytes: int = 1 << 30, buffers: int = 4,
                   seconds: float = 3.0) -> tuple[float, PowerReading]:
    """(TB/s, reading) of a DRAM stream over `buffers` random bf16 buffers of `buffer_bytes` each (rotated, so
    that L2 holds none of them), replayed back to back for `seconds`."""
    import torch

    if not isinstance(kind, StreamKind):
        raise TypeError(f"kind: expected a StreamKind, got {kind!r}")
    if not isinstance(buffer_bytes, int) or buffer_bytes < (1 << 20):
        raise ValueError(f"buffer_bytes: expected an int >= 1 MiB, got {buffer_bytes!r}")
    if not isinstance(buffers, int) or buffers < 1:
        raise ValueError(f"buffers: expected a positive int, got {buffers!r}")
    src = [torch.randn(buffer_bytes // 2, device="cuda", dtype=torch.bfloat16) for _ in range(buffers)]
    if kind is StreamKind.COPY:
        dst = [torch.empty_like(x) for x in src]
        moved = 2 * src[0].numel() * 2

        def call(i):
            dst[i].copy_(src[i])
    else:
        sums = torch.empty(buffers, device="cuda", dtype=torch.float32)
        moved = src[0].numel() * 2

        def call(i):
            torch.sum(src[i], dim=0, dtype=torch.float32, out=sums[i])
    reading = _sustain_calls(call, buffers, seconds)
    return moved / (reading.ms_per_call * 1e-3) / 1e12, reading


def idle_reading(seconds: float = 2.0, settle_s: float = 1.0) -> PowerReading:
    """The card at rest (nothing submitted) for `seconds`, after `settle_s` without work: its static draw at idle
    clocks, which is below its static draw at a loaded clock (a lower bound of the power that buys no work)."""
    import torch

    if not seconds > 0 or settle_s < 0:
        raise ValueError(f"seconds: expected > 0 with settle_s >= 0, got {seconds!r}, {settle_s!r}")
    torch.cuda.synchronize()
    time.sleep(settle_s)
    sampler = PowerSampler(torch.cuda.current_device())
    sampler.start()
    t0 = time.time()
    time.sleep(seconds)
    t1 = time.time()
    samples = sampler.stop()
    return summarize(samples, t0, t1, 0.0, sampler.power_limit_w())


def stream_joules_per_byte(streamed: PowerReading, dense: PowerReading, extra_bytes: float, idle_w: float) -> float:
    """Joules per byte of a weight stream fed by TMA: the energy above idle of a GEMM that streams `extra_bytes`
    more from DRAM (cuBLAS batched over the experts) less that of the same FLOPs without them (one dense matmul),
    over those bytes. Fitted this way because a DRAM read driven by SM loads (stream_reading) also pays for the
    SMs' work on every byte: at 4.2 TB/s such a read draws most of the power limit by itself."""
    if not extra_bytes > 0:
        raise ValueError(f"extra_bytes: expected > 0, got {extra_bytes!r}")
    spent = [(r.power_w - idle_w) * r.ms_per_call * 1e-3 for r in (streamed, dense)]
    return (spent[0] - spent[1]) / extra_bytes


@dataclasses.dataclass(frozen=True)
class EnergyModel:
    """A first-order model of a power-capped card: time >= the energy of the FLOPs and DRAM bytes over the power
    the limit leaves above the card's idle draw, besides the two rate ceilings. Fitted from sustained readings:
    the card at rest, a bf16 matmul (joules per FLOP above idle, at the limit) and a weight stream's joules per
    byte (stream_joules_per_byte: cuBLAS batched over the experts against one dense matmul, prefill_gemm_bench
    --sustain). Idle draw under-counts the static draw at a loaded clock, so the energy term is optimistic."""

    idle_w: float
    power_limit_w: float
    joules_per_flop: float
    joules_per_byte: float
    flops_per_s: float  # the matmul's sustained rate
    bytes_per_s: float  # DRAM bandwidth (the floor's copy bandwidth)

    def __post_init__(self):
        if not self.power_limit_w > self.idle_w >= 0:
            raise ValueError(f"power_limit_w: expected above idle_w ({self.idle_w}), got {self.power_limit_w}")
        for name in ("joules_per_flop", "joules_per_byte", "flops_per_s", "bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)!r}")

    @classmethod
    def from_readings(cls, idle: PowerReading, matmul_tflops: float, matmul: PowerReading, joules_per_byte: float,
                      bytes_per_s: float) -> "EnergyModel":
        limit = matmul.power_limit_w or idle.power_limit_w
        if limit is None:
            raise ValueError("readings: neither knows the power limit")
        return cls(idle.power_w, limit, (matmul.power_w - idle.power_w) / (matmul_tflops * 1e12), joules_per_byte,
                   matmul_tflops * 1e12, bytes_per_s)

    def energy_s(self, flops: float, dram_bytes: float) -> float:
        """Seconds the power limit allows for this much work, above the idle draw."""
        return (flops * self.joules_per_flop + dram_bytes * self.joules_per_byte) / (self.power_limit_w - self.idle_w)

    def bound_s(self, flops: float, dram_bytes: float) -> float:
        if flops < 0 or dram_bytes < 0:
            raise ValueError(f"flops, dram_bytes: expected >= 0, got {flops!r}, {dram_bytes!r}")
        return max(flops / self.flops_per_s, dram_bytes / self.bytes_per_s, self.energy_s(flops, dram_bytes))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def prefill_bounds(model: EnergyModel, tokens: tuple[int, ...] = (2048, 8192, 32768)) -> list[dict]:
    """For every preset and T: the floor of serving_bench/floors.py (the peers file's 4.24 TB/s and 792 TFLOP/s)
    beside the model's bound for the same FLOPs and bytes (the ideal, fused layer), as a ratio to that floor."""
    from moe2cta.planner import expected_experts_hit
    from moe2cta.presets import PRESETS
    from moe2cta.serving_bench.floors import DEFAULT_BANDWIDTH, DEFAULT_MATMUL_FLOPS, CeilingSource, Ceilings, moe_floor

    ceilings = Ceilings(DEFAULT_BANDWIDTH, DEFAULT_MATMUL_FLOPS, CeilingSource.DEFAULT)
    rows = []
    for preset in PRESETS.values():
        for t in tokens:
            hit = expected_experts_hit(t, preset.top_k, preset.num_experts)
            floor = moe_floor(preset, t, hit, ceilings)
            moved = floor.weight_bytes + floor.activation_bytes
            bound = model.bound_s(floor.flops, moved)
            rows.append({"model": preset.name, "tokens": t, "floor_us": floor.us, "bound_us": bound * 1e6,
                         "bound_over_floor": bound / floor.seconds,
                         "energy_us": model.energy_s(floor.flops, moved) * 1e6})
    return rows


class Probe(enum.Enum):
    IDLE = "idle"
    READ = "read"
    COPY = "copy"
    MATMUL = "matmul"


def _describe(reading: PowerReading) -> str:
    return (f"{reading.power_w:.0f} W (limit {reading.power_limit_w}), {reading.sm_mhz:.0f} MHz, "
            f"{reading.temperature_c:.0f} C, {'|'.join(reading.reasons) or 'no clock event'}")


def main(argv=None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m moe2cta.serving_bench.power", description=__doc__.splitlines()[0])
    parser.add_argument("--probes", nargs="+", default=["matmul"], choices=[p.value for p in Probe],
                        help="what to replay and read (default matmul); idle + matmul with --stream-pj-per-byte "
                             "also fit the energy model and print each preset's prefill bound against the floor")
    parser.add_argument("--stream-pj-per-byte", type=float, default=None, metavar="PJ",
                        help="a weight stream's energy per byte above idle (prefill_gemm_bench --sustain prints it "
                             "per GEMM: dense-bmm against dense-cublas)")
    parser.add_argument("--matmul", type=int, default=8192, metavar="SIZE", help="a SIZE^3 bf16 matmul (default 8192)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    probes = [Probe(p) for p in dict.fromkeys(args.probes)]
    if args.stream_pj_per_byte is not None and not {Probe.IDLE, Probe.MATMUL} <= set(probes):
        parser.error("--stream-pj-per-byte: needs the idle and matmul probes")
    if args.stream_pj_per_byte is not None and not args.stream_pj_per_byte > 0:
        parser.error(f"--stream-pj-per-byte: expected > 0, got {args.stream_pj_per_byte}")
    if set(probes) - {Probe.IDLE} and not args.seconds > 1.0:  # sustain() settles for the first second
        parser.error(f"--seconds: expected more than 1 (the first second settles), got {args.seconds}")
    import torch

    if not torch.cuda.is_available():
        print("power: needs a CUDA GPU", file=sys.stderr)
        return 2
    out: dict = {}
    readings: dict[Probe, tuple[float, PowerReading]] = {}  # probe: (rate, reading)
    for probe in probes:
        if probe is Probe.IDLE:
            reading = idle_reading(args.seconds)
            readings[probe] = (0.0, reading)
            out["idle"] = {"reading": reading.to_json()}
            print(f"idle {args.seconds:.1f} s: {_describe(reading)}")
        elif probe is Probe.MATMUL:
            tflops, reading = matmul_reading(args.matmul, args.seconds)
            readings[probe] = (tflops, reading)
            out["matmul"] = {"size": args.matmul, "tflops": tflops, "reading": reading.to_json()}
            print(f"{args.matmul}^3 bf16 matmul sustained {args.seconds:.1f} s: {tflops:.0f} TFLOP/s, "
                  f"{_describe(reading)}")
        else:
            tbps, reading = stream_reading(StreamKind(probe.value), seconds=args.seconds)
            readings[probe] = (tbps, reading)
            out[probe.value] = {"tbps": tbps, "reading": reading.to_json()}
            print(f"{probe.value} stream sustained {args.seconds:.1f} s: {tbps:.2f} TB/s, {_describe(reading)}")
    if args.stream_pj_per_byte is not None:
        from moe2cta.serving_bench.floors import DEFAULT_BANDWIDTH

        model = EnergyModel.from_readings(readings[Probe.IDLE][1], *readings[Probe.MATMUL],
                                          args.stream_pj_per_byte * 1e-12, DEFAULT_BANDWIDTH)
        out["model"] = model.to_json()
        out["prefill_bounds"] = prefill_bounds(model)
        print(f"energy model: idle {model.idle_w:.0f} W, {model.joules_per_flop * 1e12:.3f} pJ/FLOP, "
              f"{model.joules_per_byte * 1e12:.1f} pJ/byte streamed, limit {model.power_limit_w:.0f} W")
        for row in out["prefill_bounds"]:
            print(f"{row['model']:16s} T={row['tokens']:6d} floor {row['floor_us']:9.1f} us  bound "
                  f"{row['bound_us']:9.1f} us  {row['bound_over_floor']:.3f}x floor")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
