"""`jobs/nightly.yaml`: which job configs run each night, when, where their history goes, what fails a night.

Validated like job configs (strict types, unknown keys are errors, messages name the file and the key)
and before any job starts: a typo must fail the night in the first second, not after the first job.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from batchjob.config import DATE_PLACEHOLDER, ConfigError, JobConfig, load_config
from batchjob.yamlfile import YamlFileError, read_yaml

# cron(8)'s nicknames; @reboot is not a time of night and has no calendar form.
CRON_ALIASES = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
                "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *"}


class DefinitionError(ConfigError):
    """A nightly definition the user fixes by editing the YAML (exit 2)."""


def _int_to_float(v: Any) -> Any:
    return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


Float = Annotated[float, BeforeValidator(_int_to_float)]


def cron_fields(expr: str) -> str:
    """The five cron fields of `expr` (a nickname expanded), checked by cronsim.

    Only what cron(8) itself understands is accepted: cronsim also parses Quartz-style extensions
    (L, W, #, a seconds field) that a crontab line would silently never run.
    """
    from cronsim import CronSim, CronSimError
    from datetime import datetime

    text = " ".join(expr.split())
    if text.startswith("@"):
        if text.lower() not in CRON_ALIASES:
            raise ValueError(f"unknown cron nickname {text!r}; valid: {', '.join(CRON_ALIASES)}")
        text = CRON_ALIASES[text.lower()]
    parts = text.split()
    if len(parts) != 5:
        raise ValueError(f"a cron expression has 5 fields (minute hour day-of-month month day-of-week), "
                         f"got {len(parts)} in {expr!r}")
    try:
        sim = CronSim(text, datetime(2000, 1, 1))
    except CronSimError as err:
        raise ValueError(f"not a valid cron expression {expr!r}: {err}") from None
    if any(d < 1 for d in sim.days) or any(isinstance(w, tuple) for w in sim.weekdays):
        raise ValueError(f"{expr!r} uses L, W or # (Quartz extensions cron(8) does not run); "
                         "use plain numbers, ranges, lists and steps")
    return text


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class AlertConfig(_Section):
    max_accuracy_drop: Float | None = Field(None, ge=0, le=1, description="fail the night when a job's accuracy "
                                            "falls more than this below its previous run")
    max_error_rate: Float | None = Field(None, ge=0, le=1, description="fail the night when more than this "
                                         "fraction of a job's rows answered this run are errors")
    on_failure: str | None = Field(None, min_length=1, description="shell command run with the night's summary "
                                   "on stdin when the night fails")


class NightlyDefinition(_Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    schedule: str = Field(description="cron expression, local time")
    history: str = Field(description="folder for run records and logs (relative to this file)")
    jobs: list[str] = Field(min_length=1, description="job config YAMLs (relative to this file), run in order")
    alert: AlertConfig = AlertConfig()
    retry_errors: bool = Field(False, description="after a job, re-run its error rows once (batchjob run --retry-errors)")
    source: str | None = None

    @field_validator("schedule")
    @classmethod
    def _cron(cls, v: str) -> str:
        cron_fields(v)
        return v

    @property
    def cron(self) -> str:
        """The schedule as five plain cron fields."""
        return cron_fields(self.schedule)


def _format(path: Path, err: ValidationError) -> str:
    lines = [f"{path}: invalid nightly definition:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key (valid: name, schedule, history, jobs, alert.max_accuracy_drop, "
                         "alert.max_error_rate, alert.on_failure, retry_errors)")
        elif e["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        else:
            msg = re.sub(r"^Value error, ", "", e["msg"])
            lines.append(f"  {key}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def parse_definition(raw: Any, path: Path) -> NightlyDefinition:
    """Validate a parsed YAML document; relative paths are resolved against `path`'s folder."""
    if not isinstance(raw, dict):
        raise DefinitionError(f"{path}: a nightly definition is a YAML mapping (name:, schedule:, history:, jobs:), "
                              f"got {type(raw).__name__}")
    try:
        d = NightlyDefinition.model_validate(raw)
    except ValidationError as err:
        raise DefinitionError(_format(path, err)) from None
    base = path.parent
    jobs = [str((base / Path(j).expanduser()).resolve()) for j in d.jobs]
    return d.model_copy(update={"history": str((base / Path(d.history).expanduser()).resolve()), "jobs": jobs,
                                "source": str(path.resolve())})


def load_definition(path: str | Path) -> NightlyDefinition:
    path = Path(path)
    if not path.is_file():
        raise DefinitionError(f"{path}: nightly definition not found")
    try:
        raw = read_yaml(path, "nightly definition")
    except YamlFileError as err:
        raise DefinitionError(str(err)) from None
    return parse_definition(raw, path)


def is_definition(path: Path) -> bool:
    """True when a YAML file is a nightly definition (it has `jobs:`), not a job config."""
    try:
        raw = read_yaml(path, "YAML file")
    except YamlFileError:
        return False
    return isinstance(raw, dict) and "jobs" in raw and "dataset" not in raw


def dated_output(config: str | Path) -> bool:
    """Whether a job config writes a fresh dataset each night (`{date}` in output.directory)."""
    try:
        raw = read_yaml(Path(config), "job config")
    except YamlFileError:
        return False
    out = (raw if isinstance(raw, dict) else {}).get("output") or {}
    return isinstance(out, dict) and DATE_PLACEHOLDER in str(out.get("directory", ""))


def load_jobs(d: NightlyDefinition, date: str | None) -> list[JobConfig]:
    """Every job config of the night, validated up front; two jobs of one name would mix their history."""
    where = d.source or "nightly definition"
    configs: list[JobConfig] = []
    for i, job in enumerate(d.jobs):
        if not Path(job).is_file():
            raise DefinitionError(f"{where}: jobs.{i}: job config not found: {job}")
        try:
            configs.append(load_config(job, date=date))
        except ConfigError as err:
            raise DefinitionError(f"{where}: jobs.{i}: {err}") from None
    names = [c.job for c in configs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DefinitionError(f"{where}: jobs: two configs share the job name {dup[0]!r}; history rows are kept per "
                              "job name, so give each config its own `job:`")
    return configs
