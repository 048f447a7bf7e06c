#!/usr/bin/env python
"""Variants of the code compared in alternating rounds within one device call.

Lent GPUs differ by more than most changes, so two versions of the engine are only compared on one machine,
run after run. `stage` writes each variant's files (from a git revision, or the working tree) under
`.gpu/ab/<variant>/` in the checkout's layout; the device call carries `.gpu/ab`. There, `run` puts each
variant's files in place before its runs (in ABBA order: a round's second half reverses the first, so a drift
of the machine over the call falls on both alike), runs the command, and puts the checkout's own files back
at the end, also after a failure. `report` reads one figure out of every run's JSON and compares the variants'
medians.

    python3 scripts/ab_variants.py stage old=6f4482a new=HEAD --paths batchjob/engine
    python3 scripts/ab_variants.py run --variants old new --rounds 2 --runs /tmp/ab -- \
        python3 scripts/diag_classify_overhead.py --model qwen3_vl --calls 4 --json '{out}'
    python3 scripts/ab_variants.py report /tmp/ab --key equal.median_ms.total ragged.median_ms.total

A run's `{out}` (in any argument) is its own JSON path, `<runs>/<variant>_<round>.json`; its output goes to the
`.log` beside it, and `<runs>/runs.json` lists every run (variant, round, exit code, seconds).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE = Path(".gpu/ab")
ABSENT = "_absent.json"     # the variant's paths that must not exist while it runs
BACKUP = "_checkout"        # the checkout's own files while a variant is in place
NAME = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")   # no dashes or underscores: runs are named <variant>_<round>


def _git(*args: str, root: Path) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def stage(variants: dict[str, str], paths: list[str], root: Path = ROOT) -> dict[str, list[str]]:
    """Each variant's version of every file under `paths` that any variant has (`rev` "." is the working tree),
    written under `<root>/.gpu/ab/<variant>/`; a file a variant lacks is listed in its ABSENT file. Returns the
    files per variant."""
    bad = [name for name in variants if not NAME.match(name)]
    if bad:
        raise SystemExit(f"variant names {bad}: letters and digits only, starting with a letter")
    files: set[str] = set()
    for rev in variants.values():
        listing = (_git("ls-files", "--cached", "--others", "--exclude-standard", "--", *paths, root=root)
                   if rev == "." else _git("ls-tree", "-r", "--name-only", rev, "--", *paths, root=root))
        files.update(listing.splitlines())
    out = {}
    for name, rev in variants.items():
        folder = root / STAGE / name
        shutil.rmtree(folder, ignore_errors=True)
        absent, present = [], []
        for path in sorted(files):
            if rev == ".":
                source = root / path
                data = source.read_bytes() if source.is_file() else None
            else:
                got = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True)
                data = got.stdout if got.returncode == 0 else None
            if data is None:
                absent.append(path)
                continue
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_bytes(data)
            present.append(path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ABSENT).write_text(json.dumps(absent))
        out[name] = present
    return out


def _variant_files(folder: Path) -> tuple[list[str], list[str]]:
    present = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != ABSENT)
    return present, json.loads((folder / ABSENT).read_text())


def _put(source: Path | None, target: Path) -> None:
    """`source`'s bytes at `target` (None: no file there), and the target's stale bytecode gone: a swap within
    the second a `.pyc` was written would otherwise pass Python's mtime-and-size check."""
    if source is None:
        target.unlink(missing_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    if target.suffix == ".py":
        for cached in (target.parent / "__pycache__").glob(f"{target.stem}.*.pyc"):
            cached.unlink(missing_ok=True)


def _keep_checkout(paths: set[str], root: Path) -> dict[str, bool]:
    """The checkout's own version of `paths` kept under BACKUP (with whether each existed)."""
    backup = root / STAGE / BACKUP
    kept = {}
    for path in sorted(paths):
        kept[path] = (root / path).is_file()
        if kept[path]:
            (backup / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / path, backup / path)
    backup.mkdir(parents=True, exist_ok=True)
    (backup / "_paths.json").write_text(json.dumps(kept))
    return kept


def _restore(root: Path) -> None:
    """Put the checkout's own files back (kept under BACKUP while a variant was in place)."""
    backup = root / STAGE / BACKUP
    if not (backup / "_paths.json").is_file():
        return
    for path, existed in json.loads((backup / "_paths.json").read_text()).items():
        _put(backup / path if existed else None, root / path)
    shutil.rmtree(backup)


def _apply(name: str, kept: dict[str, bool], root: Path) -> None:
    """Variant `name`'s files in place; a path it does not stage keeps the checkout's version."""
    folder = root / STAGE / name
    present, absent = _variant_files(folder)
    for path, existed in kept.items():
        if path in present:
            _put(folder / path, root / path)
        elif path in absent or not existed:
            _put(None, root / path)
        else:
            _put(root / STAGE / BACKUP / path, root / path)


def order(variants: list[str], rounds: int) -> list[tuple[str, int]]:
    """ABBA: each round runs every variant, every other round in reverse order."""
    return [(v, r) for r in range(rounds) for v in (variants if r % 2 == 0 else variants[::-1])]


def run(variants: list[str], rounds: int, runs: Path, command: list[str], root: Path = ROOT) -> list[dict]:
    """Every (variant, round) of `order` with that variant's files in place; the checkout's files back after."""
    for name in variants:
        if not (root / STAGE / name / ABSENT).is_file():
            raise SystemExit(f"variant {name!r} is not staged under {root / STAGE}: run `stage` first")
    _restore(root)   # a run stopped half-way (killed at the call's limit) left a variant in place
    paths: set[str] = set()
    for name in variants:
        present, absent = _variant_files(root / STAGE / name)
        paths.update(present, absent)
    kept = _keep_checkout(paths, root)
    runs.mkdir(parents=True, exist_ok=True)
    done = []
    try:
        for name, r in order(variants, rounds):
            _apply(name, kept, root)
            out = runs / f"{name}_{r}.json"
            argv = [arg.replace("{out}", str(out)) for arg in command]
            t0 = time.perf_counter()
            with open(runs / f"{name}_{r}.log", "w") as log:
                rc = subprocess.run(argv, cwd=root, stdout=log, stderr=subprocess.STDOUT).returncode
            done.append({"variant": name, "round": r, "returncode": rc, "seconds": round(time.perf_counter() - t0, 1),
                         "out": str(out)})
            (runs / "runs.json").write_text(json.dumps(done, indent=1))
            print(f"{name}_{r}: exit {rc} in {done[-1]['seconds']} s", flush=True)
    finally:
        _restore(root)
    return done


def _dig(report, key: str):
    for part in key.split("."):
        if not isinstance(report, dict) or part not in report:
            return None
        report = report[part]
    return report if isinstance(report, (int, float)) else None


def report(runs: Path, keys: list[str]) -> dict:
    """Per key, each variant's values over its rounds, their median, and the median against the first
    variant's (runs that failed or lack the key are left out)."""
    listed = json.loads((runs / "runs.json").read_text())
    variants = list(dict.fromkeys(r["variant"] for r in listed))
    out: dict = {}
    for key in keys:
        values: dict[str, list[float]] = {v: [] for v in variants}
        for r in listed:
            path = Path(r["out"])
            if r["returncode"] == 0 and path.is_file():
                got = _dig(json.loads(path.read_text()), key)
                if got is not None:
                    values[r["variant"]].append(float(got))
        medians = {v: statistics.median(xs) if xs else None for v, xs in values.items()}
        base = medians[variants[0]]
        out[key] = {v: {"values": values[v], "median": medians[v],
                        "vs_first": medians[v] / base if base and medians[v] is not None else None}
                    for v in variants}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    st = sub.add_parser("stage", help="write each variant's files under .gpu/ab/<variant>/")
    st.add_argument("variants", nargs="+", metavar="NAME=REV", help="REV: a git revision, or . for the working tree")
    st.add_argument("--paths", nargs="+", default=["batchjob"])
    rn = sub.add_parser("run", help="alternate the variants' runs of a command")
    rn.add_argument("--variants", nargs="+", required=True)
    rn.add_argument("--rounds", type=int, default=2)
    rn.add_argument("--runs", type=Path, required=True, help="where each run's JSON and log go")
    rn.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command; {out} is the run's JSON")
    rp = sub.add_parser("report", help="compare one or more figures of the runs' JSON")
    rp.add_argument("runs", type=Path)
    rp.add_argument("--key", nargs="+", required=True, help="a dotted path into each run's JSON")
    a = parser.parse_args(argv)
    if a.what == "stage":
        pairs = dict(v.split("=", 1) for v in a.variants if "=" in v)
        if len(pairs) != len(a.variants):
            parser.error("each variant is NAME=REV")
        for name, files in stage(pairs, a.paths).items():
            print(f"{name}: {len(files)} files under {STAGE / name}")
    elif a.what == "run":
        command = a.command[1:] if a.command[:1] == ["--"] else a.command
        if not command:
            parser.error("the command goes after --")
        failed = [r for r in run(a.variants, a.rounds, a.runs, command) if r["returncode"] != 0]
        return 1 if failed else 0
    else:
        got = report(a.runs, a.key)
        print("| figure | variant | runs | median | vs first |\n|---|---|---|---|---|")
        for key, by_variant in got.items():
            for v, row in by_variant.items():
                ratio = "n/a" if row["vs_first"] is None else f"{row['vs_first']:.3f}x"
                median = "n/a" if row["median"] is None else f"{row['median']:.4g}"
                print(f"| {key} | {v} | {', '.join(f'{x:.4g}' for x in row['values'])} | {median} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
