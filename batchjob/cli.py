"""`batchjob`: run, validate and report nightly video-classification jobs.

Exit codes are for cron and CI: 0 done; 1 runtime failure, too many error rows, or another run holds the
output (rerunning later can help); 2 bad config or a damaged output (fix it first: the message says how).
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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from batchjob import openblas

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
out = Console(soft_wrap=True)   # never break a path across lines: users grep logs
err = Console(stderr=True, soft_wrap=True)


def _bad_config(message: str, label: str = "config error") -> typer.Exit:
    err.print(f"[bold red]{label}:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def _summary_table(stats, summary: dict | None) -> Table:
    t = Table(title="batchjob run", show_header=False)
    t.add_row("rows (dataset)", str(stats.total_rows))
    t.add_row("skipped (already done)", str(stats.skipped_rows))
    for label, n in (("answered again (question edited)", stats.edited_rows),
                     ("re-scored (answer key edited)", stats.rescored_rows),
                     ("error rows retried", stats.retried_rows)):
        if n:
            t.add_row(label, str(n))
    if stats.repaired_parts:
        t.add_row("damaged parts moved to _damaged/", ", ".join(stats.repaired_parts))
    t.add_row("answered this run", str(stats.done_rows))
    t.add_row("error rows this run", str(stats.error_rows))
    t.add_row("rows/s (whole run)", f"{stats.rows_per_s:.2f}")
    t.add_row("wall time", f"{stats.wall_s:.1f} s (streaming {stats.stream_s:.1f} s)")
    if stats.done_rows:
        t.add_row("overlap efficiency", f"{stats.overlap_efficiency:.2f} (wall / busiest stage; 1.0 = ideal)")
    if stats.model:
        t.add_row("model", stats.model)
    if stats.engine_runtime:
        rt = stats.engine_runtime
        t.add_row("engine", f"{rt.get('device')} {rt.get('dtype')}, attention {rt.get('attention_backend')}")
    if stats.memory:
        m = stats.memory
        t.add_row("memory budget", f"{m['budget_gb']:g} GiB ({m['budget_source']}); {m['device']} "
                  f"{m['device_memory_gb']:g} GiB, weights {m['weights_gb']:g} GiB, KV {m['kv_blocks']} blocks "
                  f"({m['kv_gb']:g} GiB)")
    if stats.startup is not None and stats.startup.steps:
        st = stats.startup
        steps = ", ".join(f"{s.name} {s.seconds:.1f}" for s in st.steps if s.seconds >= 0.05)
        t.add_row("start-up", f"{st.total_s:.1f} s to the first answer ({steps})")
    if len(stats.decode_nodes) > 1:
        t.add_row("decode nodes", str(len(stats.decode_nodes)))
    for label, value in _pipeline_rows(stats):
        t.add_row(label, value)
    if summary and summary.get("accuracy") is not None:
        t.add_row("accuracy (all output)", f"{summary['accuracy']:.4f} over {summary['scored']} rows")
        for cat, v in (summary.get("per_category") or {}).items():
            if len(summary["per_category"]) > 1 and v.get("accuracy") is not None:
                t.add_row(f"  {cat}", f"{v['accuracy']:.4f} over {v['n']} rows")
    return t


def _pipeline_rows(stats) -> list[tuple[str, str]]:
    """The summary's pipeline lines: resolved actors, engine busy fraction, queue depth, per-clip times."""
    if not stats.engines:
        return []
    dead = f", {len(stats.dead_replicas)} died" if stats.dead_replicas else ""
    rows = [("actors", f"{stats.engines} engine replica(s) x {stats.engine_gpus:g} GPU{dead}, "
                       f"{stats.decoders} decoder(s)")]
    if stats.gpu_busy is not None and stats.done_rows:
        per = " / ".join(f"{b:.0%}" for b in stats.engine_busy_by_replica)
        rows.append(("engine busy", f"{stats.gpu_busy:.0%} of streaming time"
                     + (f" (per replica {per})" if stats.engines > 1 else "")))
    if stats.queue_depth:
        q = stats.queue_depth
        capped = stats.queue_target_wanted > stats.queue_target
        rows.append(("decoded queue", f"min {q['min']:g} / median {q['median']:g} / max {q['max']:g} clips; target "
                     f"{stats.queue_target} per replica"
                     + (f" (the rates want {stats.queue_target_wanted}: raise runtime.frames_in_flight)" if capped
                        else "")))
    if stats.decode_ms_per_clip is not None:
        rows.append(("decode ms/clip", f"{stats.decode_ms_per_clip:.0f} (p90 {stats.decode_ms_per_clip_p90:.0f})"))
    if stats.engine_ms_per_clip is not None:
        rows.append(("engine ms/clip", f"{stats.engine_ms_per_clip:.0f} (p90 {stats.engine_ms_per_clip_p90:.0f})"))
    for loader, f in stats.fetched.items():
        share = f" ({f['file_fraction']:.1%} of each file, median)" if f.get("file_fraction") is not None else ""
        rows.append(("fetched per clip", f"{f['mb_per_clip']:.2f} MB median, p90 {f['mb_per_clip_p90']:.2f} MB{share}, "
                     f"{loader}; {f['clips']:.0f} remote clips, {f['total_mb']:.1f} MB, {f['retries']:.0f} retried requests"))
    if stats.bound_by:
        rows.append(("bound by", stats.bound_by))
    if stats.peak_rss_mb:
        rows.append(("driver peak memory", f"{stats.peak_rss_mb:.0f} MB"))
    decoders = stats.actor_peak_rss_mb.get("decoders") or []
    if stats.host_peak_mb is not None and decoders:
        rows.append(("host peak memory", f"{stats.host_peak_mb:.0f} MB over the job's processes (decoders "
                     f"{min(decoders):.0f}-{max(decoders):.0f} MB each)"))
    return rows


def _run(config: Path, *, limit: int | None, output: Path | None, restart: bool, ray_address: str | None,
         quiet: bool = False, stats_json: Path | None = None, retry_errors: bool = False, repair: bool = False,
         date: str | None = None) -> None:
    from batchjob.config import ConfigError, load_config
    from batchjob.pipeline.driver import NoEngineLeft
    from batchjob.pipeline.job import EngineStartError, JobTerminated, RunOptions, run_job
    from batchjob.pipeline.output import OutputBusy, OutputDamaged, OutputMismatch
    from batchjob.pipeline.report import summarize
    from batchjob.preflight import check_output_file

    try:
        if retry_errors and restart:
            raise ConfigError("--retry-errors re-runs the error rows of the existing output; --restart discards it")
        if repair and restart:
            raise ConfigError("--repair keeps the readable parts of the existing output; --restart discards it all")
        cfg = load_config(config, date=date).with_overrides(limit=limit, output=str(output) if output else None,
                                                 ray_address=ray_address)
        if stats_json:
            check_output_file(stats_json, "--stats-json")
    except ConfigError as e:
        raise _bad_config(str(e))
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[rate]:.2f} rows/s"), TimeRemainingColumn(),
                        TextColumn("errors {task.fields[errors]}"), console=err, disable=quiet)
    # Hidden until the run knows its rows: a config refused by the checks before it prints no empty "0/?" bar.
    task = progress.add_task(cfg.job, total=None, rate=0.0, errors=0, visible=False)

    def on_start(s) -> None:
        progress.update(task, total=s.total_rows - s.skipped_rows, completed=0, visible=True)

    def on_progress(s) -> None:
        progress.update(task, completed=s.done_rows, errors=s.error_rows,
                        rate=s.done_rows / s.stream_s if s.stream_s else 0.0)

    options = RunOptions(restart=restart, retry_errors=retry_errors, repair=repair,
                         output_key="--output" if output else None, owns_process=True)
    try:
        with progress:
            stats = run_job(cfg, options, on_start=on_start, on_progress=on_progress)
    except (ConfigError, OutputMismatch) as e:
        raise _bad_config(str(e))
    except OutputDamaged as e:
        raise _bad_config(str(e), "damaged output")
    except OutputBusy as e:
        err.print(f"[bold red]busy:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    except (EngineStartError, NoEngineLeft) as e:
        err.print(f"[bold red]engine error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    except (KeyboardInterrupt, JobTerminated) as e:
        err.print("interrupted: finished rows are saved; rerun the same command to resume")
        raise typer.Exit(143 if isinstance(e, JobTerminated) else 130)
    except Exception as e:  # a runtime failure at 3 a.m.: say what, keep what was written, exit 1
        err.print(f"[bold red]run failed:[/] {type(e).__name__}: {escape(str(e))}", highlight=False, soft_wrap=True)
        err.print("finished rows are saved; rerun the same command to resume")
        raise typer.Exit(1)
    try:
        summary = summarize(cfg.output.directory)
    except FileNotFoundError:
        summary = None
    except OutputDamaged as e:      # damaged while this run wrote (the parts were verified at its start)
        err.print(f"[bold red]damaged output:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        summary = None
    if not quiet:
        out.print(_summary_table(stats, summary))
    if stats_json:
        stats_json.write_text(json.dumps(stats.as_dict(), indent=1) + "\n")
    frac = stats.error_rows / stats.done_rows if stats.done_rows else 0.0
    if frac > cfg.runtime.max_error_fraction:
        err.print(f"[bold red]{stats.error_rows} of {stats.done_rows} rows failed ({frac:.1%}), above "
                  f"runtime.max_error_fraction {cfg.runtime.max_error_fraction:.1%}[/]; see the `error` column")
        raise typer.Exit(1)


@app.command()
def run(config: Path = typer.Argument(..., help="job config YAML"),
        limit: Optional[int] = typer.Option(None, help="only the first N questions"),
        output: Optional[Path] = typer.Option(None, help="output directory (overrides output.directory)"),
        restart: bool = typer.Option(False, help="discard existing results in the output directory"),
        ray_address: Optional[str] = typer.Option(None, help="join this Ray cluster (host:port)"),
        quiet: bool = typer.Option(False, help="no progress bar or summary"),
        stats_json: Optional[Path] = typer.Option(None, help="also write this run's statistics (rows, errors, "
                                                             "stage busy times) to this JSON file"),
        retry_errors: bool = typer.Option(False, "--retry-errors/--no-retry-errors", help="re-run only the rows "
                                          "that are error rows in the output and replace them in place"),
        repair: bool = typer.Option(False, "--repair", help="move damaged part files to OUTPUT/_damaged/ and answer "
                                    "their rows again (the other rows are kept)"),
        date: Optional[str] = typer.Option(None, help="the night (YYYY-MM-DD) for {date} in output.directory; "
                                           "default today, UTC")) -> None:
    """Run a job, or resume it: rows already in the output are skipped; rows whose question or options were
    edited are answered again, rows whose answer key was edited are re-scored."""
    _run(config, limit=limit, output=output, restart=restart, ray_address=ray_address, quiet=quiet,
         stats_json=stats_json, retry_errors=retry_errors, repair=repair, date=date)


@app.command()
def validate(config: Path = typer.Argument(..., help="job config YAML"),
             date: Optional[str] = typer.Option(None, help="the night (YYYY-MM-DD) for {date} in "
                                                "output.directory; default today, UTC")) -> None:
    """Check a config, its inputs, its clips and its existing output without running anything (exit 2 when
    the run would refuse or fail)."""
    from batchjob.config import ConfigError, load_config
    from batchjob.preflight import error_budget_problem, missing_clips, output_problems, preflight

    try:
        cfg = load_config(config, date=date)
        rows = preflight(cfg)
    except ConfigError as e:
        raise _bad_config(str(e))
    missing = missing_clips(rows)
    problems = output_problems(cfg)
    if missing.all_missing:
        problems.append(f"none of the clips exists ({missing.describe()}); check dataset.video_root and that its "
                        "disk or share is mounted")
    elif (budget := error_budget_problem(cfg, missing)) is not None:
        problems.append(f"{missing.describe()}; {budget}")
    elif missing.missing:
        err.print(f"[yellow]warning:[/] {escape(missing.describe())} (each becomes error rows)", highlight=False)
    for p in problems:
        err.print(f"[bold red]error:[/] {escape(p)}", highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(2)
    clips = len({r.video for r in rows})
    out.print(f"{config}: ok: job {cfg.job!r}, {len(rows)} questions on {clips} clips, "
              f"fingerprint {cfg.fingerprint()}, output {cfg.output.directory}", highlight=False)


@app.command()
def report(output: Path = typer.Argument(..., help="a job's output directory (or its config YAML), or a nightly "
                                         "definition with --html"),
           as_json: bool = typer.Option(False, "--json", help="machine-readable summary"),
           html: Optional[Path] = typer.Option(None, "--html", help="for a nightly definition: write a self-contained "
                                               "HTML report (charts over the nights, last night's tables) here"),
           date: Optional[str] = typer.Option(None, help="with a config whose output.directory holds {date}: that "
                                              "night's output (YYYY-MM-DD); default today, UTC")) -> None:
    """Accuracy overall and per category, throughput and errors, from the Parquet output alone."""
    from batchjob.config import ConfigError, load_config
    from batchjob.nightly.definition import is_definition
    from batchjob.pipeline.output import OutputDamaged
    from batchjob.pipeline.report import summarize

    if html is not None:
        from batchjob.nightly.commands import html_report

        html_report(output, html)
        return
    is_config = output.is_file()
    if is_config and is_definition(output):
        raise _bad_config(f"{output} is a nightly definition: use `batchjob report {output} --html OUT.html`, "
                          f"`batchjob history {output}` or `batchjob diff --last {output}`")
    if date is not None and not is_config:
        raise _bad_config(f"--date picks the night of a config's {{date}} output; {output} is not a config file "
                          "(give the output directory of that night instead)")
    if is_config:
        try:
            output = Path(load_config(output, date=date).output.directory)
        except ConfigError as e:
            raise _bad_config(str(e))
    try:
        s = summarize(output)
    except FileNotFoundError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(2)
    except OutputDamaged as e:
        raise _bad_config(str(e), "damaged output")
    if as_json:
        print(json.dumps(s, indent=2))
        return
    t = Table(title=f"{s['job'] or output}: {s['rows']} rows", show_header=True)
    t.add_column("category")
    t.add_column("n", justify="right")
    t.add_column("accuracy", justify="right")
    for cat, v in s["per_category"].items():
        t.add_row(cat, str(v["n"]), f"{v['accuracy']:.4f}")
    acc = f"{s['accuracy']:.4f}" if s["accuracy"] is not None else "n/a"
    t.add_row("[bold]overall", f"[bold]{s['scored']}", f"[bold]{acc}")
    out.print(t)
    rate = f"{s['rows_per_s']:.2f}" if s["rows_per_s"] else "n/a"
    out.print(f"errors {s['errors']}  |  loader {', '.join(s['loaders'])}  |  model {', '.join(s['models'])}  |  "
              f"{len(s['runs'])} run(s), {rate} rows/s", highlight=False)
    if s.get("loader_comparison"):
        from batchjob.loader_comparison import markdown_table, rows_from_json

        c = s["loader_comparison"]
        out.print(f"\nloaders side by side ({c.get('about', '')}):", highlight=False, markup=False)
        out.print(markdown_table(rows_from_json(c)), highlight=False, markup=False)


@app.command()
def loaders() -> None:
    """List the video loaders a config can name in `loader.name`, and the `loader.kwargs` each reads."""
    from batchjob.loaders import get_loader, list_loaders
    from batchjob.loaders.registry import describe_loader

    for name in list_loaders():
        loader = get_loader(name)
        out.print(f"[bold]{name}[/]  {escape(describe_loader(loader))}", highlight=False)
        for key, option in sorted((getattr(loader, "options", None) or {}).items()):
            out.print(f"    loader.kwargs.{key} ({option.kind.__name__}): {escape(option.help)}", highlight=False)


@app.command()
def demo(cache: Optional[Path] = typer.Option(None, help="where to build assets (default: $BATCHJOB_CACHE, else "
                                                          "$XDG_CACHE_HOME/batchjob, else ~/.cache/batchjob)"),
         clips: int = typer.Option(16, min=1, help="number of synthetic clips (3 or 4 questions each)"),
         model_type: Optional[str] = typer.Option(None, help="tiny model family: qwen3_vl (the default; trained on "
                                                  "clips whose motion no single frame shows), qwen2_5_vl (trained "
                                                  "on clips where one frame gives direction away) or qwen3_vl_moe "
                                                  "(random weights: chance)"),
         compare_loaders: bool = typer.Option(False, "--compare-loaders", help="then decode the demo's clips with "
                                              "each loader (pyav_keyframes, pyav_adaptive, opencv) and compare "
                                              "accuracy per question kind x GOP kind and decode ms per clip")) -> None:
    """Run the whole pipeline on synthetic clips with the tiny demo model trained on such clips (built locally).

    Exits 1 when a trained model's accuracy on a question kind falls below what it reached at training time
    (less a binomial margin): the chain from the file to the answer is then broken."""
    from batchjob.demo import build_demo, check_demo_accuracy, demo_names, is_trained
    from batchjob.demo_model import DEFAULT_MODEL_TYPE, check_demo_model_type

    model_type = model_type or DEFAULT_MODEL_TYPE
    try:
        check_demo_model_type(model_type, trained=compare_loaders)
    except ValueError as e:
        hint = (" (--compare-loaders needs a trained model: a random one's comparison is chance)"
                if compare_loaders else "")
        raise typer.BadParameter(f"{e}{hint}", param_hint="--model-type")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")   # everything is local; never wait on a hub lookup
    model_note = (f"trained {model_type} demo model" if is_trained(model_type)
                  else f"random-weight {model_type} model: answers are chance")
    err.print(f"building demo assets ({model_note}, synthetic clips)...")
    config = build_demo(cache, clips, model_type)
    err.print(f"running {config}")
    _run(config, limit=None, output=None, restart=True, ray_address=None)
    output = config.parent / demo_names(model_type).output
    if compare_loaders:
        from batchjob.demo import compare_demo_loaders
        from batchjob.loader_comparison import STEM, markdown_table

        err.print("comparing loaders on the demo's clips (in this process)...")
        out.print(markdown_table(compare_demo_loaders(config, model_type)), highlight=False, markup=False)
        page = output / f"{STEM}.html"
        if page.exists():
            out.print(f"loader comparison page: {page}", highlight=False)
    checks = check_demo_accuracy(config, model_type)
    if checks is not None:
        out.print("accuracy per kind against the model's training record (bar: recorded accuracy less a binomial "
                  "margin a correct run misses with probability < 1e-4):", highlight=False, markup=False)
        for c in checks:
            out.print(f"  {c.describe()}", highlight=False, markup=False)
        failed = [c.kind for c in checks if not c.passed]
        if failed:
            err.print(f"[bold red]demo accuracy below the bar:[/] {', '.join(failed)}: the chain from the file "
                      f"to the answer is broken (wrong frames, order, colours or positions); the canary "
                      f"tests/pipeline/test_demo_canary.py shows which", highlight=False)
            raise typer.Exit(1)
    out.print(f"results: batchjob report {output}", highlight=False)


@app.command()
def versions() -> None:
    """Versions and the BLAS preload, for bug reports (the same versions go into every output file)."""
    from batchjob.pipeline.job import versions as collect

    for k, v in collect().items():
        out.print(f"{k:14s} {v}", highlight=False)
    out.print(f"{'openblas':14s} {'preloaded' if openblas.preloaded(os.environ) else 'not preloaded'}",
              highlight=False)


from batchjob.nightly.commands import register as _register_nightly  # noqa: E402

_register_nightly(app)


def _reexec_with_openblas() -> None:
    """MLX's Linux CPU wheel ships a slow reference BLAS; the system OpenBLAS makes fp32 ~30x faster.

    It must be loaded before the process starts, so re-exec once with LD_PRELOAD set (cron users will
    not set it). BATCHJOB_NO_OPENBLAS=1 opts out.
    """
    if os.environ.get(openblas.NO_PRELOAD_ENV) == "1":
        return
    env = openblas.with_openblas(os.environ, linux=sys.platform.startswith("linux"),
                                 openblas_exists=os.path.exists(openblas.OPENBLAS))
    if env == dict(os.environ):
        return
    env[openblas.NO_PRELOAD_ENV] = "1"   # never loop, whatever happens to LD_PRELOAD
    os.execve(sys.executable, [sys.executable, "-m", "batchjob.cli", *sys.argv[1:]], env)


def main() -> None:
    _reexec_with_openblas()
    try:
        app(prog_name="batchjob")
    except SystemExit as done:
        from batchjob.pipeline.driver_engine import DriverEngine

        if DriverEngine.hosted:
            _end_process(done.code)
        raise


def _end_process(code) -> None:
    """End a process that hosted the engine the way an actor's process ends: flushed, then `os._exit`. A normal
    interpreter exit runs MLX's static destructors, whose worker threads then call back into the finalising
    interpreter and abort (SIGABRT after the run had finished and written everything)."""
    import logging

    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
