"""`batchjob schedule`: the definition's cron expression as a crontab line, systemd units or a launchd plist.

The cron expression is parsed once by cronsim; the systemd and launchd forms are built from its
expanded value sets (minutes, hours, days, months, weekdays), keeping cron's rule that a restricted
day-of-month and a restricted day-of-week match either one.
"""
from __future__ import annotations

import itertools
import plistlib
import shlex
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from batchjob.nightly.definition import NightlyDefinition, cron_fields

MAX_LAUNCHD_INTERVALS = 200
WEEKDAYS = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"]
FULL = {"minute": set(range(60)), "hour": set(range(24)), "day": set(range(1, 32)), "month": set(range(1, 13)),
        "weekday": set(range(7))}


class ScheduleError(ValueError):
    """The schedule cannot be written in the requested format."""


@dataclass(frozen=True)
class CronSets:
    minute: frozenset[int]
    hour: frozenset[int]
    day: frozenset[int]
    month: frozenset[int]
    weekday: frozenset[int]      # 0 = Sunday (cron's 7 folded in)
    day_or: bool                 # both day fields restricted: a day matching either runs

    def restricted(self, name: str) -> bool:
        return set(getattr(self, name)) != FULL[name]


def cron_sets(expr: str) -> CronSets:
    from cronsim import CronSim

    sim = CronSim(cron_fields(expr), datetime(2000, 1, 1))
    return CronSets(frozenset(sim.minutes), frozenset(sim.hours), frozenset(sim.days), frozenset(sim.months),
                    frozenset(w % 7 for w in sim.weekdays), not sim.day_and)


@dataclass(frozen=True)
class Invocation:
    """Absolute paths of what a scheduler runs: this checkout's `batchjob`, the definition, the log."""
    command: tuple[str, ...]       # e.g. ("/srv/batchjob/.venv/bin/batchjob",)
    definition: str
    workdir: str
    log: str

    @property
    def argv(self) -> list[str]:
        return [*self.command, "nightly", self.definition]


def invocation(d: NightlyDefinition, executable: str | None = None) -> Invocation:
    import sys

    exe = Path(executable) if executable else Path(sys.prefix) / "bin" / "batchjob"
    command = (str(exe),) if exe.is_file() else (sys.executable, "-m", "batchjob.cli")
    definition = Path(d.source or "nightly.yaml").resolve()
    return Invocation(command, str(definition), str(definition.parent), str(Path(d.history) / "logs" / "nightly.log"))


# -- cron ---------------------------------------------------------------------------------------------
def cron_line(d: NightlyDefinition, inv: Invocation) -> str:
    """A crontab entry (plus a comment line). `%` is a newline to cron, so it is escaped in the command."""
    cmd = " ".join(shlex.quote(a) for a in inv.argv)
    body = f"cd {shlex.quote(inv.workdir)} && {cmd} >> {shlex.quote(inv.log)} 2>&1".replace("%", r"\%")
    return (f"# batchjob nightly {d.name!r}: {inv.definition}. `batchjob nightly` holds a lock under the history "
            "folder, so a start that overlaps a slow night exits at once (and says so in the log).\n"
            f"{' '.join(d.schedule.split())} {body}\n")


# -- systemd ------------------------------------------------------------------------------------------
def _ranges(values: list[int]) -> str:
    out, run = [], [values[0]]
    for v in values[1:]:
        if v == run[-1] + 1:
            run.append(v)
        else:
            out.append(run)
            run = [v]
    out.append(run)
    return ",".join(f"{r[0]:02d}..{r[-1]:02d}" if len(r) > 2 else ",".join(f"{x:02d}" for x in r) for r in out)


def _field(s: CronSets, name: str) -> str:
    return _ranges(sorted(getattr(s, name))) if s.restricted(name) else "*"


def on_calendar(expr: str) -> list[str]:
    """systemd OnCalendar= values equivalent to a cron expression (two when cron ORs the day fields)."""
    s = cron_sets(expr)
    time = f"{_field(s, 'hour')}:{_field(s, 'minute')}:00"
    month, day = _field(s, "month"), _field(s, "day")
    dow = ",".join(WEEKDAYS[w] for w in sorted(s.weekday)) if s.restricted("weekday") else ""
    weekdays = dow + " " if dow else ""     # every weekday (a day field ORed with `0-6`): no weekday part
    if s.day_or:
        return [f"*-{month}-{day} {time}", f"{weekdays}*-{month}-* {time}"]
    return [f"{weekdays}*-{month}-{day} {time}"]


def _systemd_quote(arg: str) -> str:
    arg = arg.replace("%", "%%")
    if any(c in arg for c in ' \t"\'\\;$'):
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def unit_name(d: NightlyDefinition) -> str:
    return f"batchjob-nightly-{d.name}"


def systemd_units(d: NightlyDefinition, inv: Invocation) -> dict[str, str]:
    """`{name}.service` and `{name}.timer` file contents."""
    name = unit_name(d)
    log = inv.log.replace("%", "%%")
    service = f"""[Unit]
Description=batchjob nightly {d.name} ({inv.definition.replace('%', '%%')})

[Service]
Type=oneshot
WorkingDirectory={_systemd_quote(inv.workdir)}
ExecStart={' '.join(_systemd_quote(a) for a in inv.argv)}
StandardOutput=append:{log}
StandardError=append:{log}
# exit 1: a job failed or an alert fired; exit 2: the definition is invalid. Either marks the unit failed.
"""
    calendars = "\n".join(f"OnCalendar={c}" for c in on_calendar(d.schedule))
    timer = f"""[Unit]
Description=Run {name}.service on the schedule {' '.join(d.schedule.split())!r} (local time)

[Timer]
{calendars}
Unit={name}.service
# Like cron, a night missed while the machine was off is not run later; set Persistent=true to catch up.
Persistent=false

[Install]
WantedBy=timers.target
"""
    return {f"{name}.service": service, f"{name}.timer": timer}


# -- launchd ------------------------------------------------------------------------------------------
LAUNCHD_KEYS = [("minute", "Minute"), ("hour", "Hour"), ("day", "Day"), ("month", "Month"), ("weekday", "Weekday")]


def calendar_intervals(expr: str, limit: int = MAX_LAUNCHD_INTERVALS) -> list[dict[str, int]]:
    """launchd StartCalendarInterval entries matching exactly the minutes the cron expression matches.

    launchd has no ranges, lists or steps: each combination of restricted values is its own entry (a
    missing key is a wildcard). An expression that needs more than `limit` entries is refused.
    """
    s = cron_sets(expr)

    def product(names: list[str]) -> list[dict[str, int]]:
        keys = [(n, k) for n, k in LAUNCHD_KEYS if n in names and s.restricted(n)]
        values = [sorted(getattr(s, n)) for n, _ in keys]
        return [dict(zip([k for _, k in keys], combo)) for combo in itertools.product(*values)]

    base = ["minute", "hour", "month"]
    if s.day_or:
        entries = product(base + ["day"]) + product(base + ["weekday"])
    else:
        entries = product(base + ["day", "weekday"])
    if len(entries) > limit:
        raise ScheduleError(f"schedule {expr!r}: launchd has no ranges, lists or steps, so it needs one "
                            f"StartCalendarInterval entry per combination of values: {len(entries)} here, more "
                            f"than the {limit} batchjob writes. Use fewer values per field (or a plain hour and "
                            "minute) for a launchd schedule.")
    return entries


def label(d: NightlyDefinition) -> str:
    return f"com.batchjob.nightly.{d.name}"


def launchd_plist(d: NightlyDefinition, inv: Invocation) -> bytes:
    intervals = calendar_intervals(d.schedule)
    return plistlib.dumps({
        "Label": label(d),
        "ProgramArguments": inv.argv,
        "WorkingDirectory": inv.workdir,
        "StartCalendarInterval": intervals[0] if len(intervals) == 1 else intervals,
        "StandardOutPath": inv.log,
        "StandardErrorPath": inv.log,
        "RunAtLoad": False,
    })
