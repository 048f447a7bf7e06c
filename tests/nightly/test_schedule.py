"""Schedules: the cron line round-trips through cronsim; systemd's calendar and launchd's intervals fire at
exactly the minutes cron does (checked by systemd-analyze and by expanding launchd's matching rules)."""
from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import subprocess
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml
from cronsim import CronSim
from typer.testing import CliRunner

from batchjob.nightly.definition import cron_fields, load_definition
from batchjob.nightly.schedule import (ScheduleError, calendar_intervals, cron_line, invocation, launchd_plist,
                                       on_calendar, systemd_units)

FIXED = ["30 1 * * *", "@daily", "@weekly", "0 3 1,15 * 1", "*/15 9-17 * * 1-5", "5 4 * jan,jul sun",
         "0 0 */2 * *", "0 22 * * 7", "59 23 31 12 *", "0 12 1-7 * mon", "0 0 29 2 *", "10 2 * * 6,0",
         "0 9 1-15 * 0-6"]   # the last: a day field ORed with every weekday (it once gave systemd " *-*-* ...")


def random_expr(rng) -> str:
    def field(lo: int, hi: int, names: list[str] | None = None) -> str:
        kind = rng.choice(["*", "one", "list", "range", "step", "rangestep"] + (["name"] if names else []))
        a, b = sorted(rng.sample(range(lo, hi + 1), 2))
        return {"*": "*", "one": str(a), "list": ",".join(map(str, sorted(rng.sample(range(lo, hi + 1), 3)))),
                "range": f"{a}-{b}", "step": f"*/{rng.randint(2, 7)}", "rangestep": f"{a}-{b}/{rng.randint(2, 3)}",
                "name": names[a - lo] if names else ""}[kind]
    months = "jan feb mar apr may jun jul aug sep oct nov dec".split()
    return " ".join([field(0, 59), field(0, 23), field(1, 28), field(1, 12, months),
                     field(0, 6, "sun mon tue wed thu fri sat".split())])


def cron_times(expr: str, start: datetime, n: int | None = None, end: datetime | None = None) -> list[datetime]:
    out = []
    for t in CronSim(cron_fields(expr), start):
        if (n is not None and len(out) >= n) or (end is not None and t >= end):
            break
        out.append(t)
    return out


def launchd_times(entries: list[dict[str, int]], start: datetime, end: datetime) -> list[datetime]:
    """launchd's rule: an entry fires at every minute whose fields equal all of its keys (a missing key matches
    anything; Weekday 0 and 7 are Sunday)."""
    out = set()
    day = start.replace(hour=0, minute=0)
    while day < end:
        for e in entries:
            if e.get("Day", day.day) != day.day or e.get("Month", day.month) != day.month:
                continue
            if "Weekday" in e and e["Weekday"] % 7 != (day.weekday() + 1) % 7:
                continue
            for h in [e["Hour"]] if "Hour" in e else range(24):
                for m in [e["Minute"]] if "Minute" in e else range(60):
                    t = day.replace(hour=h, minute=m)
                    if start < t < end:
                        out.add(t)
        day += timedelta(days=1)
    return sorted(out)


@pytest.fixture
def nightly_def(tmp_path):
    def make(schedule: str, folder: Path = tmp_path):
        folder.mkdir(parents=True, exist_ok=True)     # a valid job: `schedule` checks the jobs before writing
        (folder / "manifest.jsonl").write_text('{"id": "a", "video": "a.mp4", "question": "q?", "options": ["x", "y"]}\n')
        (folder / "j.yaml").write_text(yaml.safe_dump({
            "job": "j", "dataset": {"adapter": "manifest", "annotation": "manifest.jsonl"},
            "model": {"checkpoint": "Org/model"}, "output": {"directory": "out"}}))
        path = folder / "nightly.yaml"
        path.write_text(yaml.safe_dump({"name": "nightly", "schedule": schedule, "history": "hist", "jobs": ["j.yaml"]}))
        return load_definition(path)
    return make


def test_launchd_intervals_fire_exactly_when_cron_does(rng):
    start, end = datetime(2026, 1, 1), datetime(2026, 3, 15)
    exprs = FIXED + [random_expr(rng) for _ in range(40)]
    checked = 0
    for expr in exprs:
        try:
            entries = calendar_intervals(expr)
        except ScheduleError:
            continue
        assert launchd_times(entries, start, end) == cron_times(expr, start, end=end), expr
        checked += 1
    assert checked >= len(FIXED)


def test_launchd_refuses_what_it_cannot_express(nightly_def):
    with pytest.raises(ScheduleError, match=r"360 here, more than the 200"):
        calendar_intervals("*/2 */2 * * *")
    d = nightly_def("*/2 */2 * * *")
    from batchjob.cli import app

    res = CliRunner().invoke(app, ["schedule", d.source, "--format", "launchd"])
    assert res.exit_code == 2 and "StartCalendarInterval" in res.output, res.output


def test_cron_line_round_trips(nightly_def, tmp_path, rng):
    for expr in FIXED[:4] + [random_expr(rng) for _ in range(5)]:
        d = nightly_def(expr, tmp_path / "with %percent")
        inv = invocation(d)
        comment, line = cron_line(d, inv).splitlines()
        assert comment.startswith("#")
        fields = line.split()[:1] if line.startswith("@") else line.split()[:5]
        parsed = " ".join(fields)
        start = datetime(2026, 5, 17, 13, 7)
        assert cron_times(parsed, start, 60) == cron_times(expr, start, 60), (expr, line)
        cmd = shlex.split(line[len(parsed):].replace(r"\%", "%"))
        assert cmd[:3] == ["cd", inv.workdir, "&&"] and cmd[3:6] == [*inv.command, "nightly", d.source][:3]
        assert cmd[-3:] == [">>", str(Path(d.history) / "logs" / "nightly.log"), "2>&1"]
        assert "%" not in line.replace(r"\%", ""), "an unescaped % is a newline to cron"
        assert Path(inv.command[0]).is_absolute() and Path(d.source).is_absolute()


def test_launchd_plist_parses(nightly_def):
    d = nightly_def("0 3 1,15 * 1")
    plist = plistlib.loads(launchd_plist(d, invocation(d)))
    assert plist["ProgramArguments"][-2:] == ["nightly", d.source] and Path(plist["ProgramArguments"][0]).exists()
    assert plist["StartCalendarInterval"] == [{"Minute": 0, "Hour": 3, "Day": 1}, {"Minute": 0, "Hour": 3, "Day": 15},
                                              {"Minute": 0, "Hour": 3, "Weekday": 1}]
    assert plist["StandardOutPath"].startswith(d.history) and plist["Label"] == "com.batchjob.nightly.nightly"
    one = plistlib.loads(launchd_plist(nightly_def("30 1 * * *"), invocation(d)))
    assert one["StartCalendarInterval"] == {"Minute": 30, "Hour": 1}


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed (apt-get install "
                                   "systemd): the unit files are still built and checked for content")


def test_systemd_units_content(nightly_def):
    d = nightly_def("0 3 1,15 * 1")
    units = systemd_units(d, invocation(d))
    service, timer = units["batchjob-nightly-nightly.service"], units["batchjob-nightly-nightly.timer"]
    assert f"nightly {d.source}" in service and "Type=oneshot" in service
    assert f"StandardOutput=append:{d.history}/logs/nightly.log" in service
    assert timer.count("OnCalendar=") == 2 and "Unit=batchjob-nightly-nightly.service" in timer


@needs_systemd
def test_systemd_units_verify(nightly_def, tmp_path):
    d = nightly_def("*/15 9-17 * * 1-5")
    out = tmp_path / "units"
    out.mkdir()
    for name, text in systemd_units(d, invocation(d)).items():
        (out / name).write_text(text)
    res = subprocess.run([SYSTEMD_ANALYZE, "verify", *map(str, sorted(out.iterdir()))], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    bad = out / "broken.timer"
    bad.write_text("[Timer]\nOnCalendar=not a time\nUnit=x.service\n")
    res = subprocess.run([SYSTEMD_ANALYZE, "verify", str(bad)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 or "not a time" in res.stderr or "Failed to parse" in res.stderr, "verify checks"


@needs_systemd
def test_systemd_calendar_fires_when_cron_does(rng):
    """systemd-analyze computes the next elapses of our OnCalendar= values; cron's come from cronsim. Both start
    from the same drawn instant (`--base-time`): with the wall clock, a firing between the two reads of it made
    the lists differ by one."""
    n = 12
    for expr in FIXED + [random_expr(rng) for _ in range(8)]:
        cals = on_calendar(expr)
        now = datetime(2026, 1, 1) + timedelta(seconds=rng.randint(0, 3 * 365 * 86400))
        res = subprocess.run([SYSTEMD_ANALYZE, "calendar", f"--iterations={n}",
                              f"--base-time={now:%Y-%m-%d %H:%M:%S} UTC", *cals], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "TZ": "UTC"})
        assert res.returncode == 0, (expr, cals, res.stderr)
        got = sorted({datetime.strptime(" ".join(line.split()[-3:-1]), "%Y-%m-%d %H:%M:%S")
                      for line in res.stdout.splitlines() if "Next elapse:" in line or "Iter. #" in line})[:n]
        want = [t for t in cron_times(expr, now, n + 1) if t > now][:n]
        assert got == want, (expr, cals)
