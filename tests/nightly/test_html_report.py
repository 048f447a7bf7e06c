"""The HTML report opens in headless Chromium with its charts drawn, no console errors and no network request.

A control page with a console error and a remote image must be caught by the same checks, so the checks
themselves can fail. Chromium comes from Debian's `chromium` package (.ci/run installs it)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from batchjob.nightly.diff import diff_rows
from batchjob.nightly.history import History

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
# CI installs Chromium (.ci/run), so there a missing browser is a failure, not a skip.
needs_chromium = pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="no Chromium on this "
                                    "machine (Debian: apt-get install chromium; CI installs it): the page is still "
                                    "built and checked as text")
TRACE_RGB = [(0x63, 0x6E, 0xFA), (0xEF, 0x55, 0x3B)]     # plotly's first two trace colours


def chromium(page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    assert CHROMIUM, "CI must have Chromium: .ci/run installs Debian's chromium package"
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--no-first-run", "--disable-sync",
                           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                           "--virtual-time-budget=8000", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=120, env=browser_env())


def browser_env() -> dict[str, str]:
    """The test environment preloads OpenBLAS (for MLX); its threads, started at load, make Chromium's GPU
    process fail to launch ("GPU process isn't usable. Goodbye.")."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def console_messages(stderr: str) -> list[str]:
    """The page's console output (Chromium's own chrome:// pages log there too)."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line and "source: file://" in line]


def page_requests(netlog: Path) -> list[str]:
    """Network requests the page itself made (Chromium's own background services excluded)."""
    events = json.loads(netlog.read_text())["events"]
    return sorted({e["params"]["url"] for e in events if "file://" in str(e.get("params", {}).get(
        "network_isolation_key", "")) and str(e["params"].get("url", "")).startswith(("http:", "https:", "ws"))})


def build_page(tmp_path: Path, rng, nh) -> tuple[Path, History, dict]:
    from batchjob.nightly.html_report import render_report

    t0 = datetime(2026, 1, 1, 1, 30, tzinfo=timezone.utc)
    recs = [nh.make_record(rng, job, f"2026-01-{n + 1:02d}", started=t0 + timedelta(days=n, minutes=i),
                           alerts=["accuracy fell <0.1>"] if (n, job) == (4, "nextqa") else [])
            for n in range(5) for i, job in enumerate(["nextqa", "mvbench"])]
    ids = [f"c{i}q{q}" for i in range(30) for q in range(3)]
    diffs = {"nextqa": diff_rows(nh.output_rows(rng, ids), nh.output_rows(rng, ids + ["new1"]))}
    history = History(recs)
    page = render_report("nightly", "/x/jobs/nightly.yaml", history, diffs,
                         {"nextqa": recs[-4], "mvbench": recs[-3]})
    path = tmp_path / "report.html"
    path.write_text(page)
    return path, history, diffs


def test_page_is_self_contained_and_complete(tmp_path, rng, nh):
    path, history, diffs = build_page(tmp_path, rng, nh)
    text = path.read_text()
    assert not re.search(r"""<(script|link|img|iframe)[^>]+(src|href)=["']?(https?:)?//""", text), "remote resource"
    assert 'id="chart-accuracy"' in text and 'id="chart-rows-per-s"' in text and "Plotly.newPlot" in text
    assert "accuracy fell &lt;0.1&gt;" in text, "text from the history is escaped"
    d = diffs["nextqa"]
    assert f"nextqa: {len(d.changed)} changed answer(s)" in text and text.count('<tr>') > len(d.changed)
    for c in d.changed:
        assert f"<td class=\"l\">{c.row_id}</td>" in text


@needs_chromium
def test_report_renders_in_headless_chromium(tmp_path, rng, nh):
    path, history, _ = build_page(tmp_path, rng, nh)
    netlog = tmp_path / "net.json"
    res = chromium(path, tmp_path, "--dump-dom", f"--log-net-log={netlog}")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    jobs = len(history.jobs())
    for chart in ("chart-accuracy", "chart-rows-per-s"):
        start = dom.index(f'id="{chart}"')
        block = dom[start:dom.find('class="chart"', start + 1) if 'class="chart"' in dom[start + 1:] else None]
        assert 'class="main-svg"' in block, f"{chart}: plotly drew no SVG"
        assert len(re.findall(r'class="trace scatter', block)) == jobs, f"{chart}: one line per job"
        assert len(re.findall(r'class="point"', block)) == jobs * 5, f"{chart}: one point per job and night"
    assert console_messages(res.stderr) == []
    assert page_requests(netlog) == []

    shot = tmp_path / "shot.png"
    res = chromium(path, tmp_path, f"--screenshot={shot}", "--window-size=1280,1400")
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20)
    for rgb in TRACE_RGB:
        n = sum(c for c, px in colours if sum(abs(a - b) for a, b in zip(px, rgb)) < 30)
        assert n > 200, f"screenshot shows no chart line in {rgb} ({n} pixels)"


@needs_chromium
def test_checks_catch_a_broken_page(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text('<html><body><div id="chart-accuracy"></div><script>console.error("boom"); missing();</script>'
                   '<img src="http://127.0.0.1:9/x.png"></body></html>')
    netlog = tmp_path / "net.json"
    res = chromium(bad, tmp_path, "--dump-dom", f"--log-net-log={netlog}")
    msgs = console_messages(res.stderr)
    assert any("boom" in m for m in msgs) and any("missing is not defined" in m for m in msgs), res.stderr[-2000:]
    assert page_requests(netlog) == ["http://127.0.0.1:9/x.png"]
    assert 'class="main-svg"' not in res.stdout
