"""scripts/ab_variants.py: variants staged from git revisions and the working tree, run in alternating rounds with
each variant's files in place, the checkout left exactly as it was (also after a failed run or a run killed
half-way), and the report's medians against NumPy."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import ab_variants  # noqa: E402

# Reads the variant's module (a fresh process each run, its bytecode cached between runs) and lists its files.
PROBE = ("import json, os, sys; sys.path.insert(0, '.'); from pkg import mod; "
         "json.dump({'value': mod.VALUE, 'files': sorted(f for f in os.listdir('pkg') if f.endswith('.py'))}, "
         "open(sys.argv[1], 'w'))")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def _snapshot(repo: Path) -> dict[str, bytes]:
    return {str(p.relative_to(repo)): p.read_bytes() for p in (repo / "pkg").rglob("*.py")}


@pytest.fixture
def repo(tmp_path) -> tuple[Path, str, str]:
    """Two commits and a working tree that differs from both: VALUE 1, 2, 3 (the same size, so a stale `.pyc`
    would pass Python's check), a file only the first commit has, one only the second, one untracked."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "pkg" / "__init__.py").write_text("")
    (repo / "pkg" / "mod.py").write_text("VALUE = 1\n")
    (repo / "pkg" / "only_old.py").write_text("")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "pkg" / "mod.py").write_text("VALUE = 2\n")
    (repo / "pkg" / "only_old.py").unlink()
    (repo / "pkg" / "only_new.py").write_text("")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "two")
    second = _git(repo, "rev-parse", "HEAD")
    (repo / "pkg" / "mod.py").write_text("VALUE = 3\n")
    (repo / "pkg" / "untracked.py").write_text("")
    return repo, first, second


def test_stage_writes_each_variants_files_and_what_it_lacks(repo):
    root, first, second = repo
    got = ab_variants.stage({"old": first, "new": second, "tree": "."}, ["pkg"], root)
    assert got["old"] == ["pkg/__init__.py", "pkg/mod.py", "pkg/only_old.py"]
    assert got["new"] == ["pkg/__init__.py", "pkg/mod.py", "pkg/only_new.py"]
    assert got["tree"] == ["pkg/__init__.py", "pkg/mod.py", "pkg/only_new.py", "pkg/untracked.py"]
    staged = root / ".gpu" / "ab"
    assert (staged / "old" / "pkg" / "mod.py").read_text() == "VALUE = 1\n"
    assert (staged / "tree" / "pkg" / "mod.py").read_text() == "VALUE = 3\n"
    assert json.loads((staged / "old" / ab_variants.ABSENT).read_text()) == ["pkg/only_new.py", "pkg/untracked.py"]
    with pytest.raises(SystemExit, match="letters and digits"):   # refused before anything is written
        ab_variants.stage({"fresh": first, "new-1": second}, ["pkg"], root)
    assert not (staged / "fresh").exists()


def test_runs_alternate_with_each_variants_files_and_the_checkout_comes_back(repo, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)   # each run leaves bytecode, as on the GPU machine
    root, first, second = repo
    before = _snapshot(root)
    ab_variants.stage({"old": first, "new": second}, ["pkg"], root)
    runs = tmp_path / "runs"
    done = ab_variants.run(["old", "new"], 3, runs, [sys.executable, "-c", PROBE, "{out}"], root)
    assert [(r["variant"], r["round"]) for r in done] == [("old", 0), ("new", 0), ("new", 1), ("old", 1),
                                                          ("old", 2), ("new", 2)]
    for r in done:
        assert r["returncode"] == 0
        got = json.loads(Path(r["out"]).read_text())
        if r["variant"] == "old":   # the untracked file stays: neither variant staged it
            assert got == {"value": 1, "files": ["__init__.py", "mod.py", "only_old.py", "untracked.py"]}
        else:
            assert got == {"value": 2, "files": ["__init__.py", "mod.py", "only_new.py", "untracked.py"]}
    assert _snapshot(root) == before and not (root / ".gpu" / "ab" / ab_variants.BACKUP).exists()
    assert json.loads((runs / "runs.json").read_text()) == done


def test_a_failed_run_and_a_killed_call_leave_the_checkout_as_it_was(repo, tmp_path):
    root, first, second = repo
    before = _snapshot(root)
    ab_variants.stage({"old": first, "new": second}, ["pkg"], root)
    fails_on_old = "import sys; sys.path.insert(0, '.'); from pkg import mod; sys.exit(3 if mod.VALUE == 1 else 0)"
    done = ab_variants.run(["old", "new"], 1, tmp_path / "runs", [sys.executable, "-c", fails_on_old], root)
    assert [r["returncode"] for r in done] == [3, 0] and _snapshot(root) == before
    # a call killed with a variant in place: the next run puts the checkout back first
    kept = ab_variants._keep_checkout({"pkg/mod.py", "pkg/only_old.py", "pkg/only_new.py", "pkg/__init__.py"}, root)
    ab_variants._apply("old", kept, root)
    assert (root / "pkg" / "mod.py").read_text() == "VALUE = 1\n"
    ab_variants.run(["new"], 1, tmp_path / "runs2", [sys.executable, "-c", "pass"], root)
    assert _snapshot(root) == before


def test_the_command_line_refuses_before_touching_anything(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab_variants.main(["stage", "old"])                       # not NAME=REV
    assert "each variant is NAME=REV" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab_variants.main(["run", "--variants", "old", "--runs", str(tmp_path)])   # no command
    assert "the command goes after --" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="not staged"):
        ab_variants.main(["run", "--variants", "nosuchvariant", "--runs", str(tmp_path), "--", "true"])


def test_report_medians_against_numpy(tmp_path, rng):
    runs, listed, want = tmp_path / "runs", [], {}
    runs.mkdir()
    rounds = int(rng.integers(1, 5))
    for variant in ("old", "new"):
        values = rng.uniform(100, 400, rounds)
        want[variant] = values
        for r, v in enumerate(values):
            out = runs / f"{variant}_{r}.json"
            out.write_text(json.dumps({"equal": {"median_ms": {"total": float(v)}}}))
            listed.append({"variant": variant, "round": r, "returncode": 0, "seconds": 1.0, "out": str(out)})
    out = runs / "failed_0.json"
    listed.append({"variant": "new", "round": rounds, "returncode": 1, "seconds": 1.0, "out": str(out)})
    (runs / "runs.json").write_text(json.dumps(listed))
    got = ab_variants.report(runs, ["equal.median_ms.total", "equal.missing"])
    row = got["equal.median_ms.total"]
    assert row["old"]["median"] == pytest.approx(float(np.median(want["old"])))
    assert row["new"]["vs_first"] == pytest.approx(float(np.median(want["new"]) / np.median(want["old"])))
    assert len(row["new"]["values"]) == rounds   # the failed run is left out
    assert got["equal.missing"]["old"] == {"values": [], "median": None, "vs_first": None}


def test_order_is_abba():
    assert ab_variants.order(["a", "b", "c"], 2) == [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1)]
