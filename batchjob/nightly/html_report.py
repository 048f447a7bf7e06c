"""`batchjob report --html`: one self-contained page for the morning after (no network needed to view it).

Charts are plotly figures with plotly.js embedded once in the page, so the file opens from a mail
attachment or a shared drive on a machine with no internet access. Everything else is plain HTML.
"""
from __future__ import annotations

import html
from datetime import datetime, timezone
from typing import Any

from batchjob.nightly.diff import OutputDiff
from batchjob.nightly.history import History, RunRecord

MAX_CHANGED_ROWS = 200      # per job: the page stays small; `batchjob diff --json` has them all
PLOT_CONFIG = {"displaylogo": False, "responsive": True}

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:0.5em 0 1.5em}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right;font-size:13px}
th{background:#f3f3f3} td.l,th.l{text-align:left}
.fail{color:#b00020;font-weight:bold} .ok{color:#08701c;font-weight:bold}
.chart{height:360px;margin-bottom:1em} .muted{color:#666;font-size:13px}
"""


def esc(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _num(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def table(headers: list[str], rows: list[list[Any]], left: int = 1, cls: str = "", text_last: bool = False) -> str:
    """Cells are HTML already (escaped by the caller); the first `left` columns (and a text last one) align left."""
    def align(i: int) -> str:
        return "l" if i < left or (text_last and i == len(headers) - 1) else ""
    head = "".join(f'<th class="{align(i)}">{esc(h)}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="{align(i)}">{c}</td>' for i, c in enumerate(r)) + "</tr>"
                   for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _chart(div_id: str, title: str, ytitle: str, series: dict[str, tuple[list[str], list[float | None]]]) -> str:
    import plotly.graph_objects as go

    fig = go.Figure([go.Scatter(x=x, y=y, mode="lines+markers", name=job) for job, (x, y) in series.items()])
    fig.update_layout(title=title, yaxis_title=ytitle, xaxis_title="night", xaxis_type="category",
                      margin=dict(l=60, r=20, t=50, b=50), legend_title_text="job")
    return fig.to_html(include_plotlyjs=False, full_html=False, div_id=div_id, config=PLOT_CONFIG,
                       default_height="360px")


def _series(history: History, field: str) -> dict[str, tuple[list[str], list[float | None]]]:
    """One point per job and night: the night's last run of the job."""
    out: dict[str, dict[str, float | None]] = {}
    for r in history.records:
        out.setdefault(r.job, {})[r.night] = getattr(r, field)
    return {job: (sorted(v), [v[n] for n in sorted(v)]) for job, v in out.items()}


def _status(r: RunRecord) -> str:
    return '<span class="fail">FAILED</span>' if r.failed else '<span class="ok">ok</span>'


def _probs(p: list[float] | None, idx: int | None) -> str:
    if p is None:
        return "error"
    return " ".join(f"<b>{v:.3f}</b>" if i == idx else f"{v:.3f}" for i, v in enumerate(p))


def _diff_section(job: str, diff: OutputDiff, labels: str = "ABCDEFGHIJ") -> str:
    rows = []
    for ch in diff.changed[:MAX_CHANGED_ROWS]:
        letter = lambda i: "-" if i is None else labels[i] if i < len(labels) else str(i)  # noqa: E731
        rows.append([esc(ch.row_id), esc(ch.category), esc(ch.question), esc(letter(ch.answer)),
                     esc(letter(ch.before)), esc(letter(ch.after)), _probs(ch.before_probs, ch.before),
                     _probs(ch.after_probs, ch.after)])
    more = (f'<p class="muted">{len(diff.changed) - MAX_CHANGED_ROWS} more; `batchjob diff --last --json` lists '
            "all</p>" if len(diff.changed) > MAX_CHANGED_ROWS else "")
    head = (f"<h3>{esc(job)}: {len(diff.changed)} changed answer(s), {len(diff.became_errors)} new error(s), "
            f"{len(diff.recovered)} recovered, {len(diff.new_rows)} new row(s), {len(diff.removed_rows)} removed</h3>"
            f'<p class="muted">{esc(diff.before)} &rarr; {esc(diff.after)}; accuracy on shared rows '
            f"{_num(diff.common_accuracy_before)} &rarr; {_num(diff.common_accuracy_after)}</p>")
    if not rows:
        return head
    return head + table(["row id", "category", "question", "answer", "before", "after", "before probs",
                          "after probs"], rows, left=3, cls="changed") + more


def render_report(name: str, source: str, history: History, diffs: dict[str, OutputDiff],
                  previous: dict[str, RunRecord | None]) -> str:
    """The whole page. `diffs`: per job, its last two outputs compared; `previous`: the baseline runs."""
    recs = history.records
    last_night = recs[-1].night if recs else None
    last = [r for r in recs if r.night == last_night]
    latest = {r.job: r for r in last}
    parts = [f"<h1>batchjob nightly: {esc(name)}</h1>",
             f'<p class="muted">{esc(source)}; generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; '
             f"{len(recs)} job run(s) over {len({r.night for r in recs})} night(s)</p>"]
    if not recs:
        parts.append("<p>No runs recorded yet: run <code>batchjob nightly</code> first.</p>")
    else:
        failed = any(r.failed for r in latest.values())
        parts.append(f"<h2>Last night: {esc(last_night)} "
                     f"{'<span class=fail>FAILED</span>' if failed else '<span class=ok>ok</span>'}</h2>")
        rows = []
        for r in latest.values():
            prev = previous.get(r.job)
            delta = (r.accuracy - prev.accuracy) if prev and prev.accuracy is not None and r.accuracy is not None \
                else None
            rows.append([esc(r.job), _status(r), esc(r.exit_status), _num(r.accuracy),
                         _num(delta, "+.4f"), esc(r.rows_answered), esc(r.error_rows), _num(r.rows_per_s, ".2f"),
                         esc(r.model_hash or "-"), esc("; ".join(r.alerts) or "-")])
        parts.append(table(["job", "status", "exit", "accuracy", "vs previous", "answered", "errors", "rows/s",
                             "model hash", "alerts"], rows, cls="last-night", text_last=True))
        parts.append('<h2>Over the nights</h2>')
        parts.append(f'<div class="chart">{_chart("chart-accuracy", "Accuracy per job", "accuracy", _series(history, "accuracy"))}</div>')
        parts.append(f'<div class="chart">{_chart("chart-rows-per-s", "Throughput per job", "rows/s", _series(history, "rows_per_s"))}</div>')
        parts.append("<h2>Per category, last night</h2>")
        for r in latest.values():
            prev = previous.get(r.job)
            crow = []
            for cat, v in sorted(r.per_category.items()):
                before = prev.per_category.get(cat, {}).get("accuracy") if prev else None
                crow.append([esc(cat), esc(int(v["n"])), _num(v["accuracy"]), _num(before),
                             _num(None if before is None else v["accuracy"] - before, "+.4f")])
            parts.append(f"<h3>{esc(r.job)}</h3>" + table(["category", "n", "accuracy", "previous", "delta"], crow,
                                                          cls="per-category"))
        parts.append("<h2>Changed answers (last two outputs of each job)</h2>")
        for job in latest:
            parts.append(_diff_section(job, diffs[job]) if job in diffs else
                         f"<h3>{esc(job)}</h3><p class=muted>no earlier output to compare with (a job without "
                         "{date} in output.directory grows one dataset: each row is answered once)</p>")
        hist_rows = [[esc(r.night), esc(r.job), _status(r), _num(r.accuracy), esc(r.rows_answered), esc(r.error_rows),
                      _num(r.rows_per_s, ".2f"), esc(r.started_at.strftime("%Y-%m-%d %H:%M:%S")), esc(r.host)]
                     for r in reversed(recs[-60:])]
        parts.append("<h2>History (newest first)</h2>" + table(
            ["night", "job", "status", "accuracy", "answered", "errors", "rows/s", "started (UTC)", "host"],
            hist_rows, left=2, cls="history"))
    return page(f"batchjob nightly {name}", "".join(parts))


def page(title: str, body: str) -> str:
    """A whole self-contained page around `body` (HTML already): the report's style, plotly.js embedded once."""
    from plotly.offline import get_plotlyjs

    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{CSS}</style>"
            f"<script>{get_plotlyjs()}</script></head><body>{body}</body></html>\n")
