"""Dataset adapters: turn a benchmark's annotation file into uniform question rows.

Every adapter yields `Row`s with a row id that is stable across runs (resume skips rows by id) and
unique within the job (checked here, because a duplicate id would make "every row exactly once"
meaningless). Videos that do not exist are NOT errors here: a missing clip becomes an error row at
run time, so one lost file never blocks a night's job.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from batchjob.config import ConfigError, DatasetConfig
from batchjob.location import LocationError, check_supported, is_url, join, local_path, scheme


class DatasetError(ConfigError):
    """The annotation file is unreadable or malformed; the message names the file and the record."""


@dataclass(frozen=True)
class Row:
    row_id: str
    video: str                   # absolute path or URL of the clip
    question: str
    options: tuple[str, ...]
    answer: int | None = None    # index into options, when the benchmark knows it
    category: str | None = None  # NExTQA question type, MVBench subtask, manifest category


def _read_table(path: Path) -> list[dict[str, Any]]:
    """CSV or Parquet as a list of dicts (pyarrow keeps NExTQA's integer columns as integers)."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    try:
        if path.suffix.lower() == ".parquet":
            # the file reader, not read_table's dataset scanner (see pipeline.output.read_conformed)
            return pq.ParquetFile(path).read(use_threads=False).to_pylist()
        if path.is_dir():  # a directory of parquet shards, as the hub ships NExTQA's MC split
            shards = sorted(path.glob("*.parquet"))
            if not shards:
                raise DatasetError(f"{path}: directory holds no .parquet files")
            return [r for s in shards for r in pq.ParquetFile(s).read(use_threads=False).to_pylist()]
        return pacsv.read_csv(path).to_pylist()
    except DatasetError:
        raise
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise DatasetError(f"{path}: cannot read as {'parquet' if path.suffix == '.parquet' else 'CSV'}: {err}") from None


def _root(video_root: str | None, default: Path) -> Path | str:
    """The configured video root (a URL stays a string), else the annotation's folder."""
    if not video_root:
        return default
    return video_root if is_url(video_root) else Path(video_root)


def _need(rec: dict[str, Any], keys: Iterable[str], where: str) -> None:
    missing = [k for k in keys if k not in rec or rec[k] is None]
    if missing:
        raise DatasetError(f"{where}: missing field(s) {', '.join(missing)}")


def _video(root: str | Path, name: str, where: str) -> str:
    """The clip `name` under `root` (a directory or URL prefix); a name that is a URL or absolute path stands
    alone. A URL carrying credentials is refused: rows are written to the output with their video."""
    try:
        check_supported(name)
    except LocationError as err:
        raise DatasetError(f"{where}: video {err}") from None
    if scheme(name) == "file":
        return local_path(name)
    return join(str(root), name)


class _VideoIndex:
    """Finds `<name>` under a root: directly, else by a one-time recursive scan (datasets nest clips in subfolders).
    Under a URL prefix the name is joined directly: listing a bucket to look for it would cost more than a
    missing clip's error row."""

    def __init__(self, root: Path | str):
        self.root = root
        self._by_name: dict[str, Path] | None = None

    def find(self, name: str) -> Path | str:
        if is_url(self.root) or is_url(name):
            return _video(self.root, name, str(self.root))
        direct = self.root / name
        if direct.exists():
            return direct
        if self._by_name is None:
            self._by_name = {p.name: p for p in self.root.rglob("*") if p.is_file()} if self.root.is_dir() else {}
        return self._by_name.get(Path(name).name, direct)  # a missing clip keeps its expected path for the error row


def load_nextqa(cfg: DatasetConfig) -> list[Row]:
    """lmms-lab/NExTQA `MC` split: video, qid, type, question, a0..a4, answer (index)."""
    path = Path(cfg.annotation)
    root = _root(cfg.video_root, path.parent)
    index = _VideoIndex(root)
    ext = cfg.options.get("video_ext", ".mp4")
    rows = []
    for i, rec in enumerate(_read_table(path)):
        where = f"{path}: record {i}"
        _need(rec, ["video", "qid", "question", "a0", "a1", "a2", "a3", "a4", "answer"], where)
        try:
            answer = int(rec["answer"])
        except (TypeError, ValueError):
            raise DatasetError(f"{where}: answer {rec['answer']!r} is not an option index 0..4") from None
        if not 0 <= answer <= 4:
            raise DatasetError(f"{where}: answer {rec['answer']!r} is not an option index 0..4")
        rows.append(Row(
            row_id=f"{rec['video']}_{rec['qid']}",
            video=str(index.find(f"{rec['video']}{ext}")),
            question=str(rec["question"]).strip(),
            options=tuple(str(rec[f"a{k}"]).strip() for k in range(5)),
            answer=answer,
            category=str(rec["type"]) if rec.get("type") is not None else None,
        ))
    return rows


def load_mvbench(cfg: DatasetConfig) -> list[Row]:
    """MVBench: one JSON list per subtask (video, question, candidates, answer text); the subtask is the category.

    `options.video_dirs` maps a subtask (JSON file stem) to its clip folder under video_root; the default is
    a folder named after the subtask (the layout scripts/prepare_mvbench.py writes).
    """
    path = Path(cfg.annotation)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise DatasetError(f"{path}: no MVBench *.json files in this directory")
    root = _root(cfg.video_root, path if path.is_dir() else path.parent)
    video_dirs = cfg.options.get("video_dirs", {})
    rows = []
    for f in files:
        try:
            items = json.loads(f.read_text())
        except (OSError, ValueError) as err:     # ValueError: JSON syntax, or not UTF-8 text at all
            raise DatasetError(f"{f}: not a readable JSON file: {err}") from None
        if not isinstance(items, list):
            raise DatasetError(f"{f}: expected a JSON list of questions, got {type(items).__name__}")
        task = f.stem
        index = _VideoIndex(join(root, video_dirs.get(task, task)) if is_url(root) else root / video_dirs.get(task, task))
        for i, rec in enumerate(items):
            where = f"{f}: item {i}"
            if not isinstance(rec, dict):
                raise DatasetError(f"{where}: expected an object")
            _need(rec, ["video", "question", "candidates", "answer"], where)
            cands = tuple(str(c) for c in rec["candidates"])
            if str(rec["answer"]) not in cands:
                raise DatasetError(f"{where}: answer {rec['answer']!r} is not one of the candidates {list(cands)}")
            rows.append(Row(row_id=f"{task}/{i}", video=str(index.find(str(rec["video"]))),
                            question=str(rec["question"]).strip(), options=cands,
                            answer=cands.index(str(rec["answer"])), category=task))
    return rows


def _manifest_answer(value: Any, options: tuple[str, ...], where: str) -> int | None:
    """An answer may be the option index, the option text, or an option letter (A, B, ...)."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise DatasetError(f"{where}: answer {value!r} is not an option index, text or letter")
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        idx = int(value)
        if 0 <= idx < len(options):
            return idx
    elif isinstance(value, str):
        if value in options:
            return options.index(value)
        letter = value.strip().upper()
        if len(letter) == 1 and 0 <= ord(letter) - ord("A") < len(options):
            return ord(letter) - ord("A")
    raise DatasetError(f"{where}: answer {value!r} is not an option index, text or letter of {list(options)}")


def load_manifest(cfg: DatasetConfig) -> list[Row]:
    """Generic manifest, JSONL (one object per line) or CSV: id, video, question, options, [answer], [category].

    In CSV, `options` is a JSON array or a `|`-separated string.
    """
    path = Path(cfg.annotation)
    root = _root(cfg.video_root, path.parent)
    records: list[tuple[str, dict[str, Any]]] = []
    try:
        if path.suffix.lower() in (".jsonl", ".json"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        records.append((f"{path}: line {n}", json.loads(line)))
                    except json.JSONDecodeError as err:
                        raise DatasetError(f"{path}: line {n}: not valid JSON: {err}") from None
        else:
            with path.open(newline="") as fh:
                records = [(f"{path}: row {n}", rec) for n, rec in enumerate(csv.DictReader(fh), 2)]
    except (OSError, UnicodeDecodeError) as err:
        raise DatasetError(f"{path}: cannot read manifest (a JSONL or CSV text file): {err}") from None
    rows = []
    for where, rec in records:
        if not isinstance(rec, dict):
            raise DatasetError(f"{where}: expected an object with id, video, question, options")
        _need(rec, ["id", "video", "question", "options"], where)
        opts = rec["options"]
        if isinstance(opts, str):
            try:
                opts = json.loads(opts) if opts.strip().startswith("[") else opts.split("|")
            except json.JSONDecodeError as err:
                raise DatasetError(f"{where}: options look like a JSON array but do not parse: {err}") from None
        if not isinstance(opts, list) or len(opts) < 2:
            raise DatasetError(f"{where}: options must be a list of at least 2 strings, got {rec['options']!r}")
        options = tuple(str(o).strip() for o in opts)
        cat = rec.get("category")
        rows.append(Row(row_id=str(rec["id"]), video=_video(root, str(rec["video"]), where),
                        question=str(rec["question"]).strip(), options=options,
                        answer=_manifest_answer(rec.get("answer"), options, where),
                        category=str(cat) if cat not in (None, "") else None))
    return rows


ADAPTERS: dict[str, Callable[[DatasetConfig], list[Row]]] = {
    "nextqa": load_nextqa,
    "mvbench": load_mvbench,
    "manifest": load_manifest,
}


def load_rows(cfg: DatasetConfig) -> list[Row]:
    """All rows of the dataset in file order (first `limit` only), with unique row ids."""
    rows = ADAPTERS[cfg.adapter](cfg)
    seen: set[str] = set()
    for r in rows:
        if r.row_id in seen:
            raise DatasetError(f"{cfg.annotation}: duplicate row id {r.row_id!r}; ids must be unique for resume")
        seen.add(r.row_id)
    if not rows:
        raise DatasetError(f"{cfg.annotation}: the dataset has no questions")
    return rows[: cfg.limit] if cfg.limit else rows
