"""serving_bench/power.py on the CPU: the nvidia-smi line parser, the window summary, argument checks. The
sampler itself reads a GPU's NVML (tests marked gpu)."""
import pytest
import torch

from moe2cta.serving_bench.power import (
    ClockEventReason,
    EnergyModel,
    PowerReading,
    PowerSample,
    PowerSampler,
    StreamKind,
    main,
    parse_smi_line,
    prefill_bounds,
    stream_joules_per_byte,
    stream_reading,
    summarize,
    sustain,
)


def test_parse_smi_line_reads_hex_reasons_and_its_own_timestamp():
    a = parse_smi_line("2026/12/01 21:40:00.100, 612.35, 1395, 0x0000000000000004, 61")
    b = parse_smi_line("2026/12/01 21:40:00.350, 700.00, 1290, 0x0000000000000000, 62")
    assert (a.power_w, a.sm_mhz, a.reasons, a.temperature_c) == (612.35, 1395.0, 4, 61.0)
    assert ClockEventReason(a.reasons) is ClockEventReason.SW_POWER_CAP
    assert b.t - a.t == pytest.approx(0.25)


@pytest.mark.parametrize("line", ["", "[N/A], 1395, 0x4, 61", "2026/12/01 21:40:00.1, [N/A], 1395, 0x4, 61",
                                  "2026/12/01 21:40:00.1, 600, 1395, 0x4"])
def test_parse_smi_line_rejects_what_is_no_sample(line):
    assert parse_smi_line(line) is None


def test_summarize_takes_medians_of_the_window_and_majority_reasons():
    cap, thermal = int(ClockEventReason.SW_POWER_CAP), int(ClockEventReason.SW_THERMAL_SLOWDOWN)
    samples = [PowerSample(0.0, 100.0, 1980, 0, 30)]  # before the window: ignored
    samples += [PowerSample(1.0 + 0.1 * j, 690.0 + j, 1300 + 10 * j, cap | (thermal if j == 0 else 0), 60)
                for j in range(5)]
    samples += [PowerSample(9.0, 50.0, 300, 1, 30)]  # after it
    reading = summarize(samples, 1.0, 1.5, ms_per_call=2.0, power_limit_w=700.0)
    assert reading.samples == 5
    assert (reading.power_w, reading.sm_mhz, reading.temperature_c) == (692.0, 1320, 60)
    assert reading.reasons == ("SW_POWER_CAP",)  # thermal in 1 of 5 samples only
    assert reading.joules_per_call() == pytest.approx(692.0 * 2e-3)
    assert reading.to_json()["joules_per_call"] == pytest.approx(1.384)


def test_summarize_without_samples_in_the_window_raises():
    with pytest.raises(RuntimeError, match="no power sample"):
        summarize([PowerSample(0.0, 100.0, 1980, 0, 30)], 1.0, 2.0, 1.0, None)


def test_sampler_and_sustain_reject_bad_arguments():
    with pytest.raises(ValueError, match="device_index"):
        PowerSampler(-1)
    with pytest.raises(ValueError, match="period_s"):
        PowerSampler(0, period_s=0)
    with pytest.raises(ValueError, match="seconds"):
        sustain(None, 4, 1.0, None, settle_s=1.0)
    with pytest.raises(ValueError, match="calls_per_replay"):
        sustain(None, 0, 2.0, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sustain_reads_power_while_a_matmul_replays():
    import time

    sampler = PowerSampler(torch.cuda.current_device())
    assert sampler.available()
    torch.cuda.synchronize()
    time.sleep(1.0)  # the board's reading is a running average: let it fall to rest first
    idle = sampler.sample()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    torch.mm(a, a, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mm(a, a, out=out)
    reading = sustain(graph, 1, 2.0, sampler, power_limit_w=sampler.power_limit_w())
    assert reading.samples >= 5
    assert 0.3 < reading.ms_per_call < 10  # 1.1 TFLOP at 110-1000 TFLOP/s
    assert reading.power_w > idle.power_w  # a matmul draws more than the card at rest
    assert 200 < reading.sm_mhz < 2100


def test_a_failed_read_in_the_sampling_thread_is_raised_by_stop(monkeypatch):
    sampler = PowerSampler(0, period_s=0.001)
    monkeypatch.setattr(sampler, "available", lambda: True)

    def broken():
        raise OSError("nvmlDeviceGetPowerUsage: NVML error 999")

    monkeypatch.setattr(sampler, "sample", broken)
    sampler.start()
    with pytest.raises(RuntimeError, match="PowerSampler: reading the .* failed: nvmlDeviceGetPowerUsage"):
        sampler.stop()


def _reading(power_w, ms_per_call=1.0, limit=700.0):
    return PowerReading(ms_per_call, power_w, 1500.0, 60.0, limit, ("SW_POWER_CAP",), 50)


def test_energy_model_is_fitted_above_the_idle_draw_and_bounds_by_the_largest_term():
    model = EnergyModel.from_readings(_reading(100.0), 600.0, _reading(700.0), 100e-12, 4e12)
    assert model.joules_per_flop == pytest.approx(600.0 / 600e12)  # 1 pJ per FLOP above idle
    # compute alone: the energy term equals the matmul's own rate (it was fitted at the limit)
    assert model.bound_s(600e12, 0) == pytest.approx(1.0)
    # memory alone: the bandwidth (4 TB/s) binds, not its energy (400 J over the 600 W above idle)
    assert model.bound_s(0, 4e12) == pytest.approx(1.0)
    assert model.energy_s(0, 4e12) == pytest.approx(400.0 / 600.0)
    # both at once: the joules add, (300 + 200) J over 600 W
    assert model.bound_s(300e12, 2e12) == pytest.approx((300.0 + 200.0) / 600.0)
    with pytest.raises(ValueError, match="power_limit_w"):
        EnergyModel(700.0, 700.0, 1e-12, 1e-10, 1e12, 1e12)
    with pytest.raises(ValueError, match="joules_per_byte"):
        EnergyModel.from_readings(_reading(100.0), 600.0, _reading(700.0), 0.0, 4e12)
    with pytest.raises(ValueError, match="flops, dram_bytes"):
        model.bound_s(-1, 0)


def test_stream_joules_per_byte_is_the_energy_above_idle_the_extra_bytes_cost():
    streamed = _reading(700.0, ms_per_call=6.0)  # (700 - 100) W x 6 ms = 3.6 J
    dense = _reading(700.0, ms_per_call=5.0)  # 3.0 J for the same FLOPs
    assert stream_joules_per_byte(streamed, dense, 30e9, idle_w=100.0) == pytest.approx(0.6 / 30e9)
    with pytest.raises(ValueError, match="extra_bytes"):
        stream_joules_per_byte(streamed, dense, 0, idle_w=100.0)


def test_prefill_bounds_cover_every_preset_and_never_fall_below_the_floor_with_slower_ceilings():
    model = EnergyModel(100.0, 700.0, 600.0 / 671e12, 350.0 / 4.0e12, 671e12, 4.0e12)
    rows = prefill_bounds(model)
    assert len(rows) == 5 * 3
    assert {r["tokens"] for r in rows} == {2048, 8192, 32768}
    for r in rows:  # rates below the floor's 4.24 TB/s and 792 TFLOP/s: the bound is above the floor
        assert r["bound_over_floor"] >= 792 / 671 - 1e-9 or r["bound_over_floor"] >= 4.24 / 4.0 - 1e-9
        assert r["bound_us"] >= r["energy_us"] - 1e-6


def test_stream_reading_checks_its_arguments():
    with pytest.raises(TypeError, match="kind"):
        stream_reading("read")
    with pytest.raises(ValueError, match="buffer_bytes"):
        stream_reading(StreamKind.READ, buffer_bytes=1024)
    with pytest.raises(ValueError, match="buffers"):
        stream_reading(StreamKind.COPY, buffers=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", list(StreamKind))
def test_gpu_stream_reading_streams_dram_at_a_plausible_rate(kind):
    tbps, reading = stream_reading(kind, buffer_bytes=1 << 28, buffers=4, seconds=1.5)
    assert 1.0 < tbps < 5.0  # H200 HBM3e: 4.8 TB/s peak
    assert reading.samples >= 5 and reading.power_w > 50


def test_power_cli_names_a_wrong_argument(capsys):
    for argv, named in ((["--probes", "matmul", "--stream-pj-per-byte", "22"], "--stream-pj-per-byte:"),  # needs idle
                        (["--probes", "idle", "matmul", "--stream-pj-per-byte", "-1"], "--stream-pj-per-byte:"),
                        (["--seconds", "0.5"], "--seconds:")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and named in capsys.readouterr().err, argv
