"""scripts/benchlib/gpu_monitor.py (what the GPU did in each section of a benchmark) and the machine details in
benchlib.env, against a stand-in nvidia-smi (tests/engine/fake_nvidia_smi.py) whose SM clock the test switches
between sections."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from benchlib import env, gpu_monitor  # noqa: E402
from benchlib.gpu_monitor import GpuMonitor, Sample, parse_sample, reason_names, summarize  # noqa: E402
from benchlib.measure import run_measured  # noqa: E402


def test_parse_sample_reads_the_stream_and_refuses_anything_else():
    s = parse_sample("2026/11/28 04:51:04.250, 1755, 2619, 512.31, 61, 99, 0x0000000000000004\n")
    assert s == Sample(time.mktime((2026, 11, 28, 4, 51, 4, 0, 0, -1)) + 0.25, 1755, 2619, 512.31, 61, 99, 4)
    na = parse_sample("2026/11/28 04:51:04, 1755, [N/A], [Not Supported], 61, 99, [N/A]")
    assert na.t == time.mktime((2026, 11, 28, 4, 51, 4, 0, 0, -1)) and na.mem_mhz is None and na.power_w is None
    assert na.reasons is None
    for bad in ("timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], "
                "temperature.gpu, utilization.gpu [%], clocks_event_reasons.active",   # a header
                "2026/11/28 04:51:04.250, 1755, 2619",                                  # cut short
                "not a time, 1755, 2619, 512.31, 61, 99, 0x0",
                "2026/11/28 04:51:04.250, [N/A], [N/A], [N/A], [N/A], [N/A], 0x0", ""):
        assert parse_sample(bad) is None, bad


def test_reason_names_decode_nvml_bits_and_keep_unknown_ones():
    assert reason_names(0) == []
    assert reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert reason_names(0x1 | 0x1000) == ["gpu_idle", "0x1000"]


def test_summarize_against_numpy(rng):
    n = int(rng.integers(3, 40))
    cols = {"sm": rng.integers(300, 1980, n).astype(float), "power": rng.uniform(80, 700, n),
            "temp": rng.integers(25, 90, n).astype(float), "util": rng.integers(0, 101, n).astype(float)}
    masks = rng.choice([0, 0x4, 0x8, 0x24, 0x1], n)
    missing = rng.random(n) < 0.2   # N/A readings of the power are left out, not counted as zero
    samples = [Sample(float(i), cols["sm"][i], 2619.0, None if missing[i] else cols["power"][i], cols["temp"][i],
                      cols["util"][i], int(masks[i])) for i in range(n)]
    got = summarize(samples)
    power = cols["power"][~missing]
    assert got["samples"] == n
    assert got["sm_mhz_median"] == round(float(np.median(cols["sm"])), 1) and got["sm_mhz_min"] == cols["sm"].min()
    assert got["mem_mhz_median"] == 2619.0 and got["temp_c_max"] == cols["temp"].max()
    assert got["util_pct_mean"] == round(float(cols["util"].mean()), 1)
    if len(power):
        assert got["power_w_median"] == round(float(np.median(power)), 1)
        assert got["power_w_max"] == round(float(power.max()), 1)
    else:
        assert "power_w_median" not in got
    for bit, name in gpu_monitor.REASONS.items():
        share = float(np.mean((masks & bit) != 0))
        assert got["reasons"].get(name, 0.0) == round(share, 3), name
    assert summarize([]) == {}


def test_sections_hold_only_their_own_samples(fake_nvidia_smi):
    """The SM clock switched between two sections: each section's samples carry only its own value, so the
    stream's timestamps were placed on the right side of the switch."""
    with GpuMonitor(interval_ms=20) as gpu:
        assert gpu.problem is None and gpu.as_dict()["reasons_field"] == "clocks_event_reasons.active"
        with gpu.section("slow"):
            time.sleep(0.5)
        time.sleep(0.05)   # stamps are cut to the millisecond: no line stamped inside "slow" reads the new clock
        fake_nvidia_smi.write_text("1500")
        time.sleep(0.05)
        start = time.perf_counter()
        time.sleep(0.5)
        gpu.record("fast", start)
        with gpu.section("fast"):   # a name met again is kept under a numbered key
            time.sleep(0.2)
    slow, fast = gpu.sections["slow"], gpu.sections["fast"]
    assert slow["samples"] >= 3 and fast["samples"] >= 3
    assert slow["sm_mhz_min"] == slow["sm_mhz_median"] == 1000
    assert fast["sm_mhz_min"] == fast["sm_mhz_median"] == 1500
    assert set(gpu.sections) == {"slow", "fast", "fast #2"} and gpu.sections["fast #2"]["sm_mhz_min"] == 1500
    assert 0 < slow["reasons"]["sw_power_cap"] < 1   # every other line holds the power cap
    whole = gpu.as_dict()["whole_run"]
    assert whole["samples"] >= slow["samples"] + fast["samples"] and whole["sm_mhz_min"] == 1000
    # one variant's rounds together, over the very spans the sections were summarised on (a span of its own
    # reading would be wider by the time between two clock readings, and a sample could land in that gap)
    both = gpu.over(gpu.spans["slow"] + gpu.spans["fast"])
    assert both["samples"] == slow["samples"] + fast["samples"] and both["sm_mhz_min"] == 1000
    assert both["sm_mhz_median"] == statistics.median([1000] * slow["samples"] + [1500] * fast["samples"])


def test_an_older_driver_gets_the_throttle_field(fake_nvidia_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_OLD", "1")
    with GpuMonitor(interval_ms=20) as gpu:
        with gpu.section("run"):
            time.sleep(0.3)
    assert gpu.as_dict()["reasons_field"] == "clocks_throttle_reasons.active"
    assert gpu.sections["run"]["samples"] >= 3 and "sw_power_cap" in gpu.sections["run"]["reasons"]


def test_without_nvidia_smi_the_monitor_says_so(tmp_path):
    with GpuMonitor(command=str(tmp_path / "missing-nvidia-smi")) as gpu:
        with gpu.section("run"):
            pass
    assert gpu.problem and "missing-nvidia-smi" in gpu.problem
    assert gpu.sections == {"run": {}} and gpu.as_dict()["whole_run"] == {}


def test_machine_details_and_a_refused_field(fake_nvidia_smi, monkeypatch):
    facts = env.gpu_facts()
    assert facts["gpu"] == "NVIDIA H100 80GB HBM3" and facts["gpus"] == 1
    details = facts["gpu_details"]
    assert details["uuid"] == "GPU-fake-0001" and details["power.limit"] == "700.00 W"
    assert set(details) == set(env.GPU_DETAILS)
    monkeypatch.setattr(env, "GPU_DETAILS", env.GPU_DETAILS + ("clocks_event_reasons.active",))
    monkeypatch.setenv("FAKE_SMI_OLD", "1")   # a field this driver refuses: the others are still recorded
    assert env.gpu_details() == details


def test_no_machine_details_without_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert env.gpu_details() == {} and env.gpu_facts() == {"gpu": "cpu", "gpus": 0}


@pytest.mark.parametrize("has_gpu", [True, False])
def test_a_measured_command_carries_the_gpu_of_its_run(has_gpu, request, monkeypatch):
    if has_gpu:
        request.getfixturevalue("fake_nvidia_smi")
    real_stop = GpuMonitor.stop

    def slow_stop(self):   # stopping the monitor is not the command's time
        time.sleep(1.0)
        real_stop(self)
    monkeypatch.setattr(GpuMonitor, "stop", slow_stop)
    got = run_measured([sys.executable, "-c", "import time; time.sleep(1.5)"], 60)
    assert got["returncode"] == 0 and 1.5 <= got["wall_s"] < 2.4
    if has_gpu:
        assert got["gpu"]["samples"] >= 1 and got["gpu"]["sm_mhz_median"] == 1000
        assert got["gpu_util_mean"] == pytest.approx(0.87)
    else:
        assert got["gpu"] == {} and got["gpu_util_mean"] is None
