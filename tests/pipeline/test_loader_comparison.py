"""The loader comparison's table (`batchjob.loader_comparison`): tallies against a count done by hand on random
outcomes, its JSON round trip, its markdown and its HTML page."""
from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from batchjob.loader_comparison import (KINDS, ClipOutcome, html_page, markdown_table, rows_from_json, tally,
                                        to_json)


def _outcomes(seed: int) -> list[ClipOutcome]:
    rng = np.random.default_rng(seed)
    out = []
    for loader in ("opencv", "pyav_keyframes"):
        for clip in range(int(rng.integers(5, 12))):
            gop = ("1key", "gop0.5s")[clip % 2]
            kinds = list(KINDS[:3]) + (["order"] if rng.random() < 0.5 else [])
            out.append(ClipOutcome(loader, gop, float(rng.uniform(1, 50)),
                                   tuple((k, bool(rng.random() < 0.7)) for k in kinds)))
    return out


def test_tally_matches_a_count_by_hand():
    seed = int.from_bytes(np.random.bytes(4), "little")
    print(f"outcomes drawn with _outcomes({seed})")
    outcomes = _outcomes(seed)
    rows = tally(outcomes)
    assert [(r.loader, r.gop) for r in rows] == [(lo, g) for lo in ("opencv", "pyav_keyframes")
                                                  for g in ("1key", "gop0.5s")]
    for row in rows:
        mine = [o for o in outcomes if o.loader == row.loader and o.gop == row.gop]
        assert row.clips == len(mine)
        assert row.decode_ms == pytest.approx(statistics.median(o.decode_ms for o in mine))
        for kind in KINDS:
            answers = [ok for o in mine for k, ok in o.answers if k == kind]
            assert row.questions[kind] == len(answers)
            assert row.accuracy[kind] == (pytest.approx(sum(answers) / len(answers)) if answers else None)


def test_json_markdown_and_page():
    rows = tally(_outcomes(7) + [ClipOutcome("opencv", "1key", 3.0, (("colour", True),))])
    back = rows_from_json(json.loads(to_json(rows, about="x")))
    assert back == rows
    text = markdown_table(rows)
    assert text.count("\n") == len(rows) + 1 and "| opencv | 1key |" in text
    pytest.importorskip("plotly")
    page = html_page(rows, "loaders <side by side>", "note & more")
    assert page.startswith("<!DOCTYPE html>") and "loaders &lt;side by side&gt;" in page
    assert 'id="chart-loaders"' in page and page.count("<tr>") == len(rows) + 1
