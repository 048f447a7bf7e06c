"""diff by row id against a brute-force comparison; alert thresholds and the summary text."""
from __future__ import annotations

import copy

import pytest

from batchjob.nightly.alerts import alerts_for, night_summary
from batchjob.nightly.definition import AlertConfig
from batchjob.nightly.diff import diff_rows


def test_diff_matches_brute_force(rng, nh):
    ids = [f"c{i:03d}q{q}" for i in range(40) for q in range(3)]
    before = nh.output_rows(rng, rng.sample(ids, 100))
    after = copy.deepcopy([r for r in before if rng.random() < 0.9])       # some rows removed
    for r in after:                                                       # re-answer some rows
        if rng.random() < 0.3:
            r.update(nh.output_rows(rng, [r["row_id"]])[0])
    have = {r["row_id"] for r in before}
    after += nh.output_rows(rng, [i for i in ids if i not in have][:7])   # a grown manifest
    rng.shuffle(after)
    d = diff_rows(before, after)

    a = {r["row_id"]: r for r in before}
    b = {r["row_id"]: r for r in after}
    both = a.keys() & b.keys()
    ok = lambda r: r["error"] is None  # noqa: E731
    assert [c.row_id for c in d.changed] == sorted(
        k for k in both if ok(a[k]) and ok(b[k]) and a[k]["pred_index"] != b[k]["pred_index"])
    assert [c.row_id for c in d.became_errors] == sorted(k for k in both if ok(a[k]) and not ok(b[k]))
    assert [c.row_id for c in d.recovered] == sorted(k for k in both if not ok(a[k]) and ok(b[k]))
    assert d.new_rows == sorted(b.keys() - a.keys()) and d.removed_rows == sorted(a.keys() - b.keys())
    assert d.common_rows == len(both) and d.rows_before == 100 and d.rows_after == len(after)
    for c in d.changed:
        assert c.before_probs == a[c.row_id]["probs"] and c.after_probs == b[c.row_id]["probs"]
        assert (c.before, c.after) == (a[c.row_id]["pred_index"], b[c.row_id]["pred_index"])
    acc = lambda rows: sum(r["correct"] for r in rows) / len(rows)  # noqa: E731
    assert d.accuracy_before == pytest.approx(acc(before)) and d.accuracy_after == pytest.approx(acc(after))
    assert d.common_accuracy_after == pytest.approx(acc([b[k] for k in both]))
    for cat in d.per_category:
        rows = [r for r in after if r["category"] == cat.category]
        assert cat.n_after == len(rows) and cat.accuracy_after == pytest.approx(acc(rows))
        assert cat.delta == pytest.approx(cat.accuracy_after - cat.accuracy_before)
    j = d.as_json()
    assert j["accuracy_delta"] == pytest.approx(d.accuracy_after - d.accuracy_before)
    assert len(j["changed"]) == len(d.changed)


def test_identical_outputs_have_no_changes(rng, nh):
    rows = nh.output_rows(rng, [f"r{i}" for i in range(30)])
    d = diff_rows(rows, copy.deepcopy(rows[::-1]))
    assert not (d.changed or d.became_errors or d.recovered or d.new_rows or d.removed_rows)
    assert d.accuracy_before == d.accuracy_after


def test_alert_thresholds(rng, nh):
    prev = nh.make_record(rng, "a", "2026-01-01", accuracy=0.80)
    cfg = AlertConfig(max_accuracy_drop=0.02, max_error_rate=0.1)
    assert alerts_for(0.78, 100, 10, 0, prev, cfg) == []                 # both exactly at the threshold
    [drop] = alerts_for(0.7799, 100, 0, 0, prev, cfg)
    assert "fell 0.0201 from 0.8000" in drop and "2026-01-01" in drop
    [errs] = alerts_for(0.9, 100, 11, 0, prev, cfg)
    assert "11 of 100" in errs
    assert alerts_for(0.1, 0, 0, 0, None, cfg) == []                      # no baseline, nothing answered
    assert alerts_for(0.1, 10, 10, 0, prev, AlertConfig()) == []          # no thresholds set
    [fail] = alerts_for(None, 0, 0, 2, prev, cfg)
    assert "exited 2 (bad config" in fail


def test_summary_lists_every_job_and_alert(rng, nh):
    prev = nh.make_record(rng, "a", "2026-01-01", accuracy=0.5)
    ok = nh.make_record(rng, "b", "2026-01-02", accuracy=0.4)
    bad = nh.make_record(rng, "a", "2026-01-02", accuracy=0.25, alerts=["accuracy fell"], log="/l/a.log")
    text = night_summary("nightly", "2026-01-02", [bad, ok], {"a": prev, "b": None})
    assert text.startswith("batchjob nightly 'nightly', night 2026-01-02: FAILED")
    assert "a: exit 0, accuracy 0.2500 (-0.2500 vs 2026-01-01)" in text and "  b: exit 0, accuracy 0.4000," in text
    assert "alerts:\n  a: accuracy fell" in text and "log a: /l/a.log" in text
    assert ": ok (1 job run(s))" in night_summary("n", "d", [ok], {})
