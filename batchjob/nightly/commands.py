"""The CLI commands of nightly jobs: nightly, history, diff, schedule, and report --html.

Registered on the main Typer app by `batchjob.cli`; heavy imports stay inside the commands.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from batchjob.config import ConfigError

WIDE = 200    # tables in cron logs and pipes (no terminal: 80 columns) would otherwise truncate every cell
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else WIDE)
err = Console(stderr=True, soft_wrap=True)


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]{'config error' if code == 2 else 'error'}:[/] {message}", highlight=False)
    return typer.Exit(code)


def _definition(path: Path):
    from batchjob.nightly.definition import load_definition

    try:
        return load_definition(path)
    except ConfigError as e:
        raise _fail(str(e))


def _num(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def nightly(definition: Path = typer.Argument(..., help="nightly definition YAML (e.g. jobs/nightly.yaml)"),
            date: Optional[str] = typer.Option(None, help="run this night (YYYY-MM-DD; backfill); default today, "
                                               "UTC")) -> None:
    """Run every job of a nightly definition, record each run in the history, alert on failure.

    Exit 0: every job done, no alert. 1: a job failed or an alert fired (on_failure ran). 1 also when
    another run of this definition holds the lock (nothing is done). 2: the definition or a job config is
    invalid (on_failure runs then too, when the definition names one).
    """
    from batchjob.config import night_date
    from batchjob.nightly.definition import load_definition, load_jobs
    from batchjob.nightly.runner import NightlyBusy, alert_not_started, lock_history, run_night

    try:
        night = night_date(date)
    except ConfigError as e:
        raise _fail(str(e))
    d = None
    try:
        d = load_definition(definition)
        configs = load_jobs(d, night)
    except ConfigError as e:
        status = alert_not_started(definition, d, night, str(e))
        if status not in (None, 0):
            err.print(f"on_failure exited {status}")
        raise _fail(str(e))
    try:
        fd = lock_history(Path(d.history), d.name)
    except NightlyBusy as e:
        raise _fail(str(e), code=1)
    try:
        result = run_night(d, configs, night, echo=lambda s: err.print(s, highlight=False))
    finally:
        os.close(fd)
    out.print(result.summary, highlight=False, end="")
    if result.on_failure_status not in (None, 0):
        err.print(f"on_failure exited {result.on_failure_status} (see {Path(d.history) / 'logs' / night})")
    raise typer.Exit(1 if result.failed else 0)


def history(definition: Path = typer.Argument(..., help="nightly definition YAML"),
            as_json: bool = typer.Option(False, "--json", help="one JSON object per run, newest first"),
            job: Optional[str] = typer.Option(None, help="only this job"),
            limit: int = typer.Option(30, min=1, help="at most this many runs")) -> None:
    """The run history of a nightly definition, newest first."""
    from batchjob.nightly.history import read_history

    d = _definition(definition)
    h = read_history(d.history)
    for bad in h.unreadable:
        err.print(f"[yellow]warning:[/] unreadable history file left out: {bad}", highlight=False)
    if job is not None:
        _known_job(d, h, job)
    recs = [r for r in reversed(h.records) if job is None or r.job == job][:limit]
    if as_json:
        print(json.dumps([r.as_json() for r in recs], indent=1))
        return
    t = Table(title=f"{d.name}: {len(h.records)} run(s) in {d.history}", show_header=True)
    for col in ("night", "job", "exit", "accuracy", "answered", "errors", "rows/s", "started (UTC)", "model hash",
                "alerts"):
        t.add_column(col, justify="left" if col in ("night", "job", "alerts", "started (UTC)") else "right")
    for r in recs:
        t.add_row(r.night, r.job, str(r.exit_status), _num(r.accuracy), str(r.rows_answered), str(r.error_rows),
                  _num(r.rows_per_s, ".2f"), r.started_at.strftime("%Y-%m-%d %H:%M:%S"), r.model_hash or "-",
                  "; ".join(r.alerts) or "-", style="red" if r.failed else None)
    out.print(t)


def _definition_jobs(d) -> list[str]:
    """The job names of the definition's configs that load (best effort: a broken one is left out)."""
    from batchjob.config import load_config

    names = []
    for path in d.jobs:
        try:
            names.append(load_config(path).job)
        except ConfigError:
            continue
    return names


def _known_job(d, h, job: str) -> None:
    """--job must name a job of the definition or of its history: a typo is exit 2, not an empty answer."""
    if job in h.jobs():
        return
    known = sorted(set(h.jobs()) | set(_definition_jobs(d)))
    if job not in known:
        raise _fail(f"--job: no job named {job!r} in {d.source} or its history (jobs: {', '.join(known) or 'none'})")
    err.print(f"job {job!r} has no runs in the history yet", highlight=False)


def _print_diff(job: str | None, df, max_rows: int) -> None:
    """One OutputDiff as tables: accuracy with deltas, then the rows that changed."""
    out.print(f"[bold]{job + ': ' if job else ''}{df.before} -> {df.after}[/]", highlight=False)
    t = Table(show_header=True)
    for col in ("", "before", "after", "delta"):
        t.add_column(col, justify="left" if not col else "right")
    sub = lambda a, b: None if a is None or b is None else b - a  # noqa: E731
    t.add_row("accuracy (whole output)", _num(df.accuracy_before), _num(df.accuracy_after),
              _num(sub(df.accuracy_before, df.accuracy_after), "+.4f"))
    t.add_row(f"accuracy ({df.common_rows} shared rows)", _num(df.common_accuracy_before),
              _num(df.common_accuracy_after), _num(sub(df.common_accuracy_before, df.common_accuracy_after), "+.4f"))
    for c in df.per_category:
        t.add_row(f"  {c.category} (n {c.n_before} -> {c.n_after})", _num(c.accuracy_before), _num(c.accuracy_after),
                  _num(c.delta, "+.4f"))
    t.add_row("rows/s", _num(df.rows_per_s_before, ".2f"), _num(df.rows_per_s_after, ".2f"),
              _num(sub(df.rows_per_s_before, df.rows_per_s_after), "+.2f"))
    t.add_row("rows", str(df.rows_before), str(df.rows_after), f"{df.rows_after - df.rows_before:+d}")
    out.print(t)
    out.print(f"models: {', '.join(df.models_before) or '-'} -> {', '.join(df.models_after) or '-'}", highlight=False)
    out.print(f"{len(df.changed)} changed answer(s), {len(df.became_errors)} became error(s), {len(df.recovered)} "
              f"recovered, {len(df.new_rows)} new row(s), {len(df.removed_rows)} removed row(s)", highlight=False)
    for title, rows in (("changed answers", df.changed), ("became errors", df.became_errors),
                        ("recovered", df.recovered)):
        if not rows:
            continue
        ct = Table(title=title, show_header=True)
        for col in ("row id", "category", "answer", "before", "after", "before probs", "after probs"):
            ct.add_column(col)
        for ch in rows[:max_rows]:
            fmt = lambda p: "error" if p is None else " ".join(f"{x:.3f}" for x in p)  # noqa: E731
            opt = lambda i: "-" if i is None else f"{i}: {ch.options[i]}" if i < len(ch.options) else str(i)  # noqa
            ct.add_row(ch.row_id, ch.category or "-", opt(ch.answer), "error" if ch.before_error else opt(ch.before),
                       "error" if ch.after_error else opt(ch.after), fmt(ch.before_probs), fmt(ch.after_probs))
        out.print(ct)
        if len(rows) > max_rows:
            out.print(f"... {len(rows) - max_rows} more (--max-rows, or --json for all)")
    if df.new_rows:
        out.print(f"new rows: {', '.join(df.new_rows[:max_rows])}{' ...' if len(df.new_rows) > max_rows else ''}",
                  highlight=False)
    if df.removed_rows:
        out.print(f"removed rows: {', '.join(df.removed_rows[:max_rows])}", highlight=False)


def _last_diffs(d, job: str | None) -> dict:
    """Per job, its two most recent outputs from the history, compared."""
    from batchjob.nightly.diff import diff_outputs
    from batchjob.nightly.history import last_two_outputs, read_history

    from batchjob.pipeline.output import OutputDamaged

    h = read_history(d.history)
    jobs = [job] if job else h.jobs()
    if job and job not in h.jobs():
        if job not in _definition_jobs(d):
            raise _fail(f"--job: no job named {job!r} in {d.source} or its history (jobs: "
                        f"{', '.join(sorted(set(h.jobs()) | set(_definition_jobs(d)))) or 'none'})")
        raise _fail(f"{d.source}: no run of job {job!r} in the history {d.history} (jobs there: "
                    f"{', '.join(h.jobs()) or 'none'})", code=1)
    diffs, missing = {}, []
    for j in jobs:
        pair = last_two_outputs(h, j)
        if pair is None:
            missing.append(j)
            continue
        try:
            diffs[j] = diff_outputs(pair[0].output, pair[1].output)
        except (FileNotFoundError, OutputDamaged) as e:
            missing.append(f"{j} ({e})")
    if not diffs:
        raise _fail(f"no job of {d.source} has two runs with different output directories in its history "
                    f"({', '.join(missing) or 'no runs yet'}). A job without {{date}} in output.directory grows one "
                    "dataset and answers each row once: put {date} in output.directory to compare nights.", code=1)
    for j in missing:
        err.print(f"[yellow]{j}: fewer than two outputs to compare; left out[/]", highlight=False)
    return diffs


def diff(before: Optional[Path] = typer.Argument(None, help="the older job output directory"),
         after: Optional[Path] = typer.Argument(None, help="the newer job output directory"),
         last: Optional[Path] = typer.Option(None, "--last", help="a nightly definition: compare each job's two most "
                                             "recent runs from its history"),
         job: Optional[str] = typer.Option(None, help="with --last: only this job"),
         as_json: bool = typer.Option(False, "--json", help="machine-readable, every row"),
         max_rows: int = typer.Option(50, min=0, help="rows listed per section (text output)")) -> None:
    """What changed between two outputs: accuracy, per category, changed answers, errors, new rows, speed."""
    from batchjob.nightly.diff import diff_outputs

    if last is not None:
        if before is not None or after is not None:
            raise _fail("give either two output directories or --last DEFINITION, not both")
        diffs = _last_diffs(_definition(last), job)
    else:
        from batchjob.pipeline.output import OutputDamaged

        if before is None or after is None:
            raise _fail("give two output directories (older first), or --last DEFINITION")
        try:
            diffs = {None: diff_outputs(before, after)}
        except FileNotFoundError as e:
            raise _fail(str(e))
        except OutputDamaged as e:
            err.print(f"[bold red]damaged output:[/] {escape(str(e))}", highlight=False)
            raise typer.Exit(2)
    if as_json:
        payload = {k or "": v.as_json() for k, v in diffs.items()}
        print(json.dumps(payload if last is not None else payload[""], indent=1, default=str))
        return
    for j, dfv in diffs.items():
        _print_diff(j, dfv, max_rows)


def _check_jobs(d) -> None:
    """Every job of the definition passes `validate`'s blocking checks now, not at 3 a.m."""
    from batchjob.nightly.definition import load_jobs
    from batchjob.preflight import missing_clips, preflight

    try:
        configs = load_jobs(d, None)
    except ConfigError as e:
        raise _fail(str(e))
    for i, cfg in enumerate(configs):
        try:
            rows = preflight(cfg)
        except ConfigError as e:
            raise _fail(f"{d.source}: jobs.{i}: {e}")
        missing = missing_clips(rows)
        if missing.missing:
            err.print(f"[yellow]warning:[/] {cfg.job}: {missing.describe()}", highlight=False)


def schedule(definition: Path = typer.Argument(..., help="nightly definition YAML"),
             fmt: str = typer.Option("cron", "--format", help="cron | systemd | launchd"),
             write_dir: Optional[Path] = typer.Option(None, help="also write the file(s) into this folder")) -> None:
    """Print a crontab line, a systemd .service + .timer pair, or a launchd plist for the definition."""
    from batchjob.nightly.schedule import (ScheduleError, cron_line, invocation, label, launchd_plist,
                                           systemd_units, unit_name)

    from batchjob.preflight import check_output_dir

    d = _definition(definition)
    _check_jobs(d)
    if write_dir is not None:
        try:
            check_output_dir(write_dir, "--write-dir")
        except ConfigError as e:
            raise _fail(str(e))
    inv = invocation(d)
    Path(inv.log).parent.mkdir(parents=True, exist_ok=True)    # the scheduler appends to it
    try:
        if fmt == "cron":
            files = {f"{unit_name(d)}.crontab": cron_line(d, inv)}
        elif fmt == "systemd":
            files = systemd_units(d, inv)
        elif fmt == "launchd":
            files = {f"{label(d)}.plist": launchd_plist(d, inv).decode()}
        else:
            raise _fail(f"--format: expected cron, systemd or launchd, got {fmt!r}")
    except ScheduleError as e:
        raise _fail(str(e))
    for name, text in files.items():
        if len(files) > 1:
            print(f"# ---- {name} ----")
        print(text, end="" if text.endswith("\n") else "\n")
        if write_dir is not None:
            write_dir.mkdir(parents=True, exist_ok=True)
            (write_dir / name).write_text(text)
    if fmt == "systemd":
        err.print(f"install: copy both into ~/.config/systemd/user/ (or /etc/systemd/system/), then "
                  f"`systemctl --user enable --now {unit_name(d)}.timer`", highlight=False)
    elif fmt == "launchd":
        err.print(f"install: save as ~/Library/LaunchAgents/{label(d)}.plist, then "
                  f"`launchctl load ~/Library/LaunchAgents/{label(d)}.plist`", highlight=False)
    else:
        err.print("install: add the line with `crontab -e`", highlight=False)


def html_report(definition: Path, target: Path) -> None:
    """`batchjob report DEFINITION --html OUT.html`."""
    from batchjob.nightly.definition import is_definition
    from batchjob.nightly.diff import diff_outputs
    from batchjob.nightly.history import last_two_outputs, previous_run, read_history
    from batchjob.nightly.html_report import render_report

    from batchjob.pipeline.output import OutputDamaged
    from batchjob.preflight import check_output_file

    if not (definition.is_file() and is_definition(definition)):
        raise _fail(f"{definition}: --html needs a nightly definition (a YAML with jobs:, e.g. jobs/nightly.yaml)")
    d = _definition(definition)
    try:
        check_output_file(target, "--html", create_parents=True)
    except ConfigError as e:
        raise _fail(str(e))
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise _fail("the HTML report draws its charts with plotly: pip install 'batchjob[report]'", code=1)
    h = read_history(d.history)
    diffs, previous = {}, {}
    for job in h.jobs():
        pair = last_two_outputs(h, job)
        if pair is not None:
            try:
                diffs[job] = diff_outputs(pair[0].output, pair[1].output)
            except (FileNotFoundError, OutputDamaged) as e:
                err.print(f"[yellow]{job}: its outputs cannot be compared; left out:[/] {escape(str(e))}",
                          highlight=False)
        latest = h.of_job(job)[-1]
        previous[job] = previous_run(h, job, before=latest.started_at)
    page = render_report(d.name, str(d.source), h, diffs, previous)
    from batchjob.pipeline.output import atomic_write_bytes

    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, page.encode())
    out.print(f"wrote {target} ({len(page) / 1e6:.1f} MB, {len(h.records)} run(s))", highlight=False)


def register(app: typer.Typer) -> None:
    app.command()(nightly)
    app.command()(history)
    app.command()(diff)
    app.command()(schedule)
