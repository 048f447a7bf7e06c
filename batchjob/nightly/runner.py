"""`batchjob nightly`: every job of a definition in turn, one history row per job run, alerts, on_failure.

Each job runs as its own `batchjob run` process (as cron would run it): a job that crashes or is killed
by the OOM killer costs that job, not the night, and its exit code lands in the history. A lock on the
history folder keeps a slow night from overlapping the next one.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable

from batchjob.config import JobConfig
from batchjob.nightly.alerts import alerts_for, night_summary
from batchjob.nightly.checkpoint_hash import checkpoint_hash
from batchjob.nightly.definition import NightlyDefinition
from batchjob.nightly.history import RunRecord, append_record, previous_run, read_history

LOCK = "nightly.lock"
ON_FAILURE_TIMEOUT_S = 300


class NightlyBusy(RuntimeError):
    """Another `batchjob nightly` holds this definition's lock."""


@dataclass(frozen=True)
class NightResult:
    records: list[RunRecord]
    summary: str
    failed: bool
    on_failure_status: int | None = None     # None: not run


def lock_history(history: Path, name: str) -> int:
    """Non-blocking exclusive lock (dies with the process, so a killed night never leaves it stale)."""
    history.mkdir(parents=True, exist_ok=True)
    path = history / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = ""
        try:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        except OSError:
            pass
        os.close(fd)
        raise NightlyBusy(f"nightly {name!r} is already running ({holder or 'holder unknown'}; lock {path}); "
                          "this run exits without doing anything") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started "
                  f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}\n".encode(), 0)
    return fd


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class _ChildTerm:
    """Forwards SIGTERM to the running job (which flushes its rows and stops Ray), then stops the night."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.terminated = False
        self._prev = None

    def __enter__(self) -> "_ChildTerm":
        try:
            self._prev = signal.signal(signal.SIGTERM, self._on_term)
        except ValueError:         # not the main thread
            self._prev = None
        return self

    def _on_term(self, signum, frame) -> None:
        self.terminated = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def __exit__(self, *exc) -> None:
        if self._prev is not None:
            signal.signal(signal.SIGTERM, self._prev)


def _die_with_parent() -> None:
    """Linux: the job gets SIGTERM (flush, stop Ray) if the nightly process is killed, instead of running on
    unrecorded beside the next night."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_job_process(cfg: JobConfig, night: str, log: Path, term: _ChildTerm, *, retry_errors: bool = False,
                    extra_env: dict[str, str] | None = None) -> tuple[int, dict]:
    """`batchjob run` in a child process, output appended to `log`; returns its exit code and statistics."""
    with tempfile.TemporaryDirectory(prefix="batchjob-nightly-") as tmp:
        stats_path = Path(tmp) / "stats.json"
        cmd = [sys.executable, "-m", "batchjob.cli", "run", str(cfg.source), "--quiet", "--date", night,
               "--stats-json", str(stats_path)]
        if retry_errors:
            cmd.append("--retry-errors")
        with open(log, "ab") as fh:
            fh.write(f"[{datetime.now(timezone.utc).isoformat(timespec='seconds')}] {' '.join(cmd)}\n".encode())
            fh.flush()
            term.child = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**os.environ, **(extra_env or {})}, preexec_fn=_die_with_parent)
            code = term.child.wait()
            term.child = None
            fh.write(f"[{datetime.now(timezone.utc).isoformat(timespec='seconds')}] exit {code}\n".encode())
        stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {}
    return code, stats


def _output_summary(directory: str) -> dict:
    from batchjob.pipeline.output import OutputDamaged
    from batchjob.pipeline.report import summarize

    try:
        return summarize(directory)
    except (FileNotFoundError, OSError, OutputDamaged):
        return {}


def _output_errors(directory: str) -> int:
    """Error rows in a job's whole output: those of earlier nights too, which `retry_errors` retries as well."""
    from batchjob.pipeline.output import OutputDamaged
    from batchjob.pipeline.retry import error_row_ids

    try:
        return len(error_row_ids(Path(directory)))
    except (OSError, OutputDamaged):
        return 0


def build_record(*, d: NightlyDefinition, cfg: JobConfig, night: str, nightly_run_id: str, started: datetime,
                 finished: datetime, code: int, stats: dict, summary: dict, previous: RunRecord | None,
                 model_hash: str | None, log: Path | None) -> RunRecord:
    answered, errors = int(stats.get("done_rows", 0)), int(stats.get("error_rows", 0))
    accuracy = summary.get("accuracy")
    wall = (finished - started).total_seconds()
    return RunRecord(
        nightly_run_id=nightly_run_id, night=night, job=cfg.job, config=str(cfg.source),
        fingerprint=cfg.fingerprint(), output=cfg.output.directory, model=cfg.model.checkpoint,
        model_hash=model_hash, engine_model=stats.get("model") or None, loader=cfg.loader.name,
        started_at=started, finished_at=finished, rows_total=int(stats.get("total_rows", 0)),
        rows_answered=answered, error_rows=errors, output_rows=int(summary.get("rows", 0)),
        output_error_rows=int(summary.get("errors", 0)), accuracy=accuracy,
        per_category=summary.get("per_category", {}),
        rows_per_s=answered / wall if answered and wall > 0 else None, exit_status=code,
        alerts=alerts_for(accuracy, answered, errors, code, previous, d.alert),
        batchjob_version=_version("batchjob"), mlx_version=_version("mlx"), av_version=_version("av"),
        ray_version=_version("ray"), host=socket.gethostname(), log=str(log) if log else None)


def run_on_failure(command: str, summary: str, log: Path | None, env: dict[str, str]) -> int:
    """The user's alert hook, summary on stdin; its own failure is logged, never fatal. Without a log file its
    output goes to our stderr (which the scheduler's line sends to nightly.log)."""
    with (open(log, "ab") if log is not None else open(os.dup(sys.stderr.fileno()), "wb")) as fh:
        fh.write(f"[{datetime.now(timezone.utc).isoformat(timespec='seconds')}] on_failure: {command}\n".encode())
        fh.flush()
        try:
            return subprocess.run(command, shell=True, input=summary.encode(), stdout=fh, stderr=subprocess.STDOUT,
                                  timeout=ON_FAILURE_TIMEOUT_S, env={**os.environ, **env}).returncode
        except subprocess.TimeoutExpired:
            fh.write(f"on_failure timed out after {ON_FAILURE_TIMEOUT_S} s\n".encode())
            return 124


def _raw_alert(path: Path) -> tuple[str | None, str | None, str]:
    """on_failure, history folder and name from a definition that does not validate (best effort: a typo
    elsewhere in the file must not silence the alert it asks for)."""
    from batchjob.yamlfile import YamlFileError, read_yaml

    try:
        raw = read_yaml(path, "nightly definition")
    except YamlFileError:
        return None, None, path.stem
    raw = raw if isinstance(raw, dict) else {}
    alert = raw.get("alert") if isinstance(raw.get("alert"), dict) else {}
    command = alert.get("on_failure") if isinstance(alert.get("on_failure"), str) and alert["on_failure"] else None
    history = str((path.parent / raw["history"]).resolve()) if isinstance(raw.get("history"), str) else None
    return command, history, str(raw.get("name") or path.stem)


def alert_not_started(path: Path, d: NightlyDefinition | None, night: str, problem: str) -> int | None:
    """A night that cannot start (its definition or a job config is invalid: exit 2) alerts like a failed one.
    Returns on_failure's exit status, None when there is no hook to run."""
    command, history, name = (d.alert.on_failure, d.history, d.name) if d is not None else _raw_alert(path)
    if not command:
        return None
    summary = night_summary(name, night, [], {}, [f"the night did not start (exit 2): {problem}"])
    log = None
    if history:
        try:
            (Path(history) / "logs" / night).mkdir(parents=True, exist_ok=True)
            log = Path(history) / "logs" / night / "on_failure.log"
        except OSError:
            log = None
    return run_on_failure(command, summary, log, {"BATCHJOB_NIGHTLY": name, "BATCHJOB_NIGHT": night})


def run_night(d: NightlyDefinition, configs: list[JobConfig], night: str,
              echo: Callable[[str], None] = lambda s: None) -> NightResult:
    """Run every job, record each run as it ends, then decide and report. The caller holds the lock."""
    history_dir = Path(d.history)
    logs = history_dir / "logs" / night
    logs.mkdir(parents=True, exist_ok=True)
    nightly_run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    hist = read_history(history_dir)
    records: list[RunRecord] = []
    previous: dict[str, RunRecord | None] = {}
    problems = [f"history file unreadable (left out): {u}" for u in hist.unreadable]
    with _ChildTerm() as term:
        for cfg in configs:
            if term.terminated:
                problems.append(f"{cfg.job}: not run (the night was terminated)")
                continue
            log = logs / f"{cfg.job}.log"
            echo(f"[{night}] {cfg.job}: batchjob run {cfg.source} (log {log})")
            started = datetime.now(timezone.utc)
            code, stats = run_job_process(cfg, night, log, term)
            # stats exist only when the run finished (exit 1 then means: too many error rows). The output's
            # error rows are retried, earlier nights' included: a grown dataset keeps them otherwise.
            pending = _output_errors(cfg.output.directory) if d.retry_errors and stats and not term.terminated else 0
            if pending:
                echo(f"[{night}] {cfg.job}: retrying {pending} error row(s) in its output")
                code2, stats2 = run_job_process(cfg, night, log, term, retry_errors=True)
                if stats2:
                    stats = after_retry(stats, stats2)
                    code = _recheck(cfg, stats)
                else:
                    code = code2 or 1
            finished = datetime.now(timezone.utc)
            summary = _output_summary(cfg.output.directory)
            previous[cfg.job] = previous_run(hist, cfg.job)
            record = build_record(d=d, cfg=cfg, night=night, nightly_run_id=nightly_run_id, started=started,
                                  finished=finished, code=code, stats=stats, summary=summary,
                                  previous=previous[cfg.job],
                                  model_hash=checkpoint_hash(cfg.model.checkpoint, history_dir / "model_hashes.json"),
                                  log=log)
            append_record(history_dir, record)
            records.append(record)
            echo(f"[{night}] {cfg.job}: exit {code}" + (f"; {'; '.join(record.alerts)}" if record.alerts else ""))
    summary_text = night_summary(d.name, night, records, previous, problems)
    failed = any(r.failed for r in records) or bool(problems)
    status = None
    if failed and d.alert.on_failure:
        status = run_on_failure(d.alert.on_failure, summary_text, logs / "on_failure.log",
                                {"BATCHJOB_NIGHTLY": d.name, "BATCHJOB_NIGHT": night})
    return NightResult(records, summary_text, failed, status)


def after_retry(first: dict, retry: dict) -> dict:
    """The night's statistics once its error rows were retried: rows answered this night include the earlier
    nights' error rows answered again; the error rows are those still failing after the retry."""
    answered_again = max(retry.get("done_rows", 0) - first.get("error_rows", 0), 0)
    return {**first, "done_rows": first.get("done_rows", 0) + answered_again, "error_rows": retry.get("error_rows", 0)}


def _recheck(cfg: JobConfig, stats: dict) -> int:
    """Exit status after a successful retry of a run that had exited 1 only for its error fraction."""
    answered = stats.get("done_rows", 0)
    frac = stats.get("error_rows", 0) / answered if answered else 0.0
    return 1 if frac > cfg.runtime.max_error_fraction else 0

