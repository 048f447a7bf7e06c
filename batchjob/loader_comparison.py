"""Loaders side by side on demo clips: accuracy per question kind x GOP kind, and decode ms per clip.

The product's trade-off, shown with the trained demo model: keyframe-only decoding is cheap and sees colour
and count on any clip, but motion (direction, order) only where keyframes are spread over the clip; exact
uniform frames see everything and pay a decode from each frame's keyframe. Every loader decodes the same
clips with the same frame count and the same in-process `Classifier` answers, so the rows differ only by the
loader. Decode ms is the loader's call alone (median per clip): a diagnostic of the decoders, not a job's
throughput. Used by `scripts/compare_loaders.py` and `batchjob demo --compare-loaders`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

LOADERS = ("pyav_keyframes", "pyav_adaptive", "opencv")
STEM = "loader_comparison"    # <STEM>.json / .html in a job's output directory (`batchjob report` shows the table)
KINDS = ("colour", "count", "direction", "order")


@dataclass(frozen=True)
class ClipOutcome:
    """One clip decoded by one loader and its questions answered."""

    loader: str
    gop: str
    decode_ms: float
    answers: tuple[tuple[str, bool], ...]     # (question kind, answered right)


@dataclass(frozen=True)
class ComparisonRow:
    loader: str
    gop: str
    clips: int
    decode_ms: float                          # median per clip
    accuracy: dict[str, float | None]         # per question kind; None: no such question on these clips
    questions: dict[str, int]


def tally(outcomes: Iterable[ClipOutcome], kinds: Sequence[str] = KINDS) -> list[ComparisonRow]:
    """Rows per (loader, GOP kind), loaders in first-seen order, GOP kinds sorted."""
    outcomes = list(outcomes)
    loaders = list(dict.fromkeys(o.loader for o in outcomes))
    gops = sorted({o.gop for o in outcomes})
    ms: dict[tuple[str, str], list[float]] = defaultdict(list)
    right: dict[tuple[str, str, str], list[bool]] = defaultdict(list)
    for o in outcomes:
        ms[(o.loader, o.gop)].append(o.decode_ms)
        for kind, ok in o.answers:
            right[(o.loader, o.gop, kind)].append(ok)
    rows = []
    for loader in loaders:
        for gop in gops:
            if not ms[(loader, gop)]:
                continue
            got = {k: right.get((loader, gop, k), []) for k in kinds}
            rows.append(ComparisonRow(loader, gop, len(ms[(loader, gop)]), float(statistics.median(ms[(loader, gop)])),
                                      {k: (sum(v) / len(v) if v else None) for k, v in got.items()},
                                      {k: len(v) for k, v in got.items()}))
    return rows


def compare_loaders(clips_dir: str | Path, records: Sequence[dict], classifier, num_frames: int,
                    loaders: Sequence[str] = LOADERS) -> list[ComparisonRow]:
    """Decode every clip of `records` (manifest records with `video`, `gop`, `category`, question, options,
    answer) with each loader and answer its questions with `classifier` (a `batchjob.engine.Classifier`)."""
    from batchjob.engine import ClassifyRequest, Clip
    from batchjob.loaders import get_loader, load_video

    for name in loaders:
        get_loader(name)      # an unknown name fails here, before any work, with the registry's message
    by_clip: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_clip[r["video"]].append(r)
    outcomes = []
    for loader in loaders:
        for video, questions in by_clip.items():
            t0 = time.perf_counter()
            frames, meta = load_video(str(Path(clips_dir) / video), backend=loader, num_frames=num_frames)
            ms = (time.perf_counter() - t0) * 1000
            clip = Clip(frames, meta, f"{loader}:{video}")
            answers = classifier.classify([ClassifyRequest(q["id"], clip, q["question"], q["options"])
                                           for q in questions])
            outcomes.append(ClipOutcome(loader, questions[0]["gop"], ms, tuple(
                (q["category"], a.error is None and a.choice == q["answer"]) for q, a in zip(questions, answers))))
    return tally(outcomes)


def markdown_table(rows: Sequence[ComparisonRow], kinds: Sequence[str] = KINDS) -> str:
    """Accuracy (questions) per kind, then the median decode ms per clip."""
    lines = ["| loader | GOP | " + " | ".join(kinds) + " | decode ms per clip (median) |",
             "|---|---|" + "---|" * len(kinds) + "---|"]
    for row in rows:
        cells = [f"{row.accuracy[k]:.2f} ({row.questions[k]})" if row.accuracy.get(k) is not None else "-"
                 for k in kinds]
        lines.append(f"| {row.loader} | {row.gop} | " + " | ".join(cells) + f" | {row.decode_ms:.1f} |")
    return "\n".join(lines)


def to_json(rows: Sequence[ComparisonRow], **about) -> str:
    return json.dumps({**about, "rows": [asdict(r) for r in rows]}, indent=1) + "\n"


def rows_from_json(data: dict) -> list[ComparisonRow]:
    """Rows back from `to_json`'s document (parsed)."""
    return [ComparisonRow(**r) for r in data["rows"]]


def html_page(rows: Sequence[ComparisonRow], title: str, note: str = "", kinds: Sequence[str] = KINDS) -> str:
    """A self-contained page (the nightly report's style and embedded plotly): the table, accuracy per kind
    as grouped bars per GOP kind, and decode ms per clip."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from batchjob.nightly.html_report import PLOT_CONFIG, esc, page, table

    gops = sorted({r.gop for r in rows})
    fig = make_subplots(rows=1, cols=len(gops) + 1, subplot_titles=[f"accuracy, GOP {g}" for g in gops]
                        + ["decode ms per clip (median)"])
    for i, loader in enumerate(dict.fromkeys(r.loader for r in rows)):
        mine = {r.gop: r for r in rows if r.loader == loader}
        for col, gop in enumerate(gops, 1):
            if gop in mine:
                fig.add_trace(go.Bar(x=list(kinds), y=[mine[gop].accuracy.get(k) for k in kinds], name=loader,
                                     legendgroup=loader, showlegend=col == 1, marker_color=_COLOURS[i % 6]),
                              row=1, col=col)
        fig.add_trace(go.Bar(x=list(mine), y=[mine[g].decode_ms for g in mine], name=loader, legendgroup=loader,
                             showlegend=False, marker_color=_COLOURS[i % 6]), row=1, col=len(gops) + 1)
    fig.update_yaxes(range=[0, 1.02], row=1, col=1)
    for col in range(2, len(gops) + 1):
        fig.update_yaxes(range=[0, 1.02], row=1, col=col)
    fig.update_layout(barmode="group", margin=dict(l=50, r=20, t=60, b=40), legend_title_text="loader")
    chart = fig.to_html(include_plotlyjs=False, full_html=False, div_id="chart-loaders", config=PLOT_CONFIG,
                        default_height="380px")
    cells = [[esc(r.loader), esc(r.gop), esc(r.clips)] + [
        "-" if r.accuracy.get(k) is None else f"{r.accuracy[k]:.2f} ({r.questions[k]})" for k in kinds]
        + [f"{r.decode_ms:.1f}"] for r in rows]
    body = (f"<h1>{esc(title)}</h1>" + (f'<p class="muted">{esc(note)}</p>' if note else "")
            + table(["loader", "GOP", "clips", *kinds, "decode ms per clip"], cells, left=2, cls="loaders")
            + f'<div class="chart">{chart}</div>')
    return page(title, body)


_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
