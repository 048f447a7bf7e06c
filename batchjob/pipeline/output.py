"""The job's output: one Parquet dataset (a directory of part files) that survives SIGKILL at any instant.

Crash safety comes from two rules. A part file is only ever visible under its final name once it is
complete: it is written under a hidden temporary name (`.part-00007.parquet.tmp`, which pyarrow's dataset
discovery and `*.parquet` globs such as DuckDB's skip), fsynced, renamed, and the directory fsynced.
Resume trusts only `part-*.parquet` names, so whatever a killed run left behind is either a whole part or
a temporary that is deleted. Rows are written once per run and skipped by id on the next, so each row
ends up exactly once.

A part damaged after it was written (a failing disk, a bad copy) is found when the output is read: parts
carry page checksums and a CRC-32 of all their pages, and every reader here verifies both (the footer is
parsed, not checksummed: damage there that still parses, a flipped column statistic, is not seen). Nothing
reads past a damaged part silently: `run` refuses until `--repair` moves it to `_damaged/` (its rows are
then answered again), and `report` and `diff` name it and say so.
"""
from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST = "_job.json"
DAMAGED = "_damaged"        # where --repair moves damaged parts (readers skip `_` folders)
METADATA_KEY = b"batchjob"
BODY_CRC_KEY = b"batchjob.body_crc32"   # CRC-32 of the bytes before the footer (see write_part)

SCHEMA = pa.schema([
    ("row_id", pa.string()),
    ("video", pa.string()),
    ("question", pa.string()),
    ("options", pa.list_(pa.string())),
    ("answer", pa.int32()),           # index of the correct option, null when the dataset has none
    ("category", pa.string()),
    ("pred_index", pa.int32()),       # null on error rows
    ("pred_letter", pa.string()),
    ("probs", pa.list_(pa.float32())),
    ("correct", pa.bool_()),          # null when answer is unknown; false on error rows
    ("loader", pa.string()),
    ("num_frames", pa.int32()),
    ("frame_indices", pa.list_(pa.int64())),
    ("decode_ms", pa.float32()),
    ("engine_ms", pa.float32()),      # the engine call that answered this row (shared by its batch)
    ("prompt_tokens", pa.int32()),
    ("cached_tokens", pa.int32()),
    ("error", pa.string()),
    ("model", pa.string()),
    ("decode_node", pa.string()),     # Ray node id of the decoder (scale-out check, debugging)
    ("run_id", pa.string()),
    ("run_started_at", pa.timestamp("ms", tz="UTC")),
    ("finished_at", pa.timestamp("ms", tz="UTC")),
])


class OutputMismatch(Exception):
    """The output directory holds results of a different config (fingerprint): exit 2."""


class OutputBusy(Exception):
    """Another run holds the output directory's lock: exit 1 (it is not a config problem; try again later)."""


@dataclass(frozen=True)
class DamagedPart:
    path: Path
    reason: str


class OutputDamaged(Exception):
    """Part files that cannot be read back; the message names each and the fix."""

    def __init__(self, directory: Path, damaged: list[DamagedPart], config: str | None = None):
        self.directory, self.damaged = directory, damaged
        run = f"batchjob run {config}" if config else "batchjob run CONFIG"
        lines = [f"{directory}: {len(damaged)} damaged part file(s), written complete but unreadable now "
                 "(disk or copy damage):"]
        lines += [f"  {d.path.name}: {d.reason}" for d in damaged]
        lines.append(f"fix: `{run} --repair` moves them to {directory / DAMAGED}/ and answers their rows again "
                     "(every other row is kept); or move them out of the folder yourself and rerun; or "
                     "`--restart` to discard the whole output")
        super().__init__("\n".join(lines))


def lock_output(directory: Path) -> int:
    """Exclusive lock on the output for this run; two runs into one directory would duplicate rows.

    An flock dies with its process, so a SIGKILLed run never leaves a stale lock. Returns the fd to keep.
    """
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "_lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputBusy(f"{directory}: another batchjob run is writing here; wait for it or use --output") from None
    return fd


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """`.name.tmp` beside `path`: hidden from dataset readers (leading dot) and from `*.parquet` globs."""
    return path.with_name(f".{path.name}.tmp")


def atomic_write(path: Path, write: Callable[[BinaryIO], None], tmp: Path | None = None) -> None:
    """Write through a temporary name (default `temporary_name`), fsync, rename, fsync the directory: a crash
    never leaves a torn file, and an exception (Ctrl-C included) leaves no temporary either."""
    tmp = tmp or temporary_name(path)
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda fh: fh.write(data))


def complete_parts(directory: Path, suffix: str = ".parquet") -> list[Path]:
    return sorted(directory.glob(f"part-*{suffix}"))


def _encode(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, write_page_checksum=True)
    return sink.getvalue().to_pybytes()


def _body(blob: bytes) -> bytes:
    """Everything before the footer: the magic number and every page with its header. Page checksums cover
    page data only, so damage to a page header (its statistics, say) would read back unnoticed without this."""
    if len(blob) < 12 or blob[-4:] != b"PAR1":
        raise ValueError("not a Parquet file (no PAR1 magic number at its end)")
    footer = int.from_bytes(blob[-8:-4], "little")
    if footer + 12 > len(blob):
        raise ValueError(f"footer length {footer} does not fit in a {len(blob)}-byte file")
    return blob[: len(blob) - 8 - footer]


def _body_crc(body: bytes) -> bytes:
    return b"%08x:%d" % (zlib.crc32(body), len(body))


def _stale(stored: bytes, body: bytes) -> bool:
    """Whether the pages differ from what was written. Bytes changed in place keep the pages' length and fail the
    CRC; a part re-encoded by another Parquet writer (which copies the schema's metadata, this CRC included) has
    pages of another length and is that writer's to vouch for: its own page checksums, if any, still apply."""
    crc, _, length = stored.partition(b":")
    if not length.isdigit():
        return True                     # the footer's value itself is damaged
    return int(length) == len(body) and crc != b"%08x" % zlib.crc32(body)


def write_part(path: Path, table: pa.Table) -> None:
    """A part file, atomically, with page checksums and a CRC-32 of every byte before the footer in the footer's
    metadata, so later damage anywhere in the pages is found instead of read as data. The pages do not depend on
    the footer's metadata, so encoding once more with the CRC added leaves them byte for byte the same."""
    meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != BODY_CRC_KEY}
    body = _body(_encode(table.replace_schema_metadata(meta)))
    blob = _encode(table.replace_schema_metadata({**meta, BODY_CRC_KEY: _body_crc(body)}))
    if _body(blob) != body:      # would mean pyarrow's pages depend on the footer: never store a wrong CRC
        raise RuntimeError(f"{path}: Parquet pages changed with the footer's metadata; cannot checksum the part")
    atomic_write_bytes(path, blob)


class PartUnreadable(Exception):
    """One part file cannot be read back (truncated, garbled, not Parquet)."""

    def __init__(self, damaged: DamagedPart):
        super().__init__(f"{damaged.path}: {damaged.reason}")
        self.damaged = damaged


def read_part(path: Path, columns: list[str] | None = None) -> pa.Table:
    """One part in the output schema, every checksum verified; raises PartUnreadable with the reason."""
    try:
        blob = path.read_bytes()
        body = _body(blob)
        file = pq.ParquetFile(pa.BufferReader(blob), page_checksum_verification=True)
        renamed = _renamed_columns(file.schema_arrow.names)
        table = read_conformed(file, SCHEMA)
        stored = (file.metadata.metadata or {}).get(BODY_CRC_KEY)   # the footer's own (the footer parsed once)
    except (pa.ArrowException, OSError, ValueError, EOFError) as err:
        raise PartUnreadable(DamagedPart(path, _reason(err))) from None
    if renamed:
        raise PartUnreadable(DamagedPart(path, renamed))
    if stored is not None and _stale(stored, body):
        raise PartUnreadable(DamagedPart(path, f"CRC-32 of its pages is {_body_crc(body).decode()} (CRC:bytes), "
                                               f"written as {stored.decode(errors='replace')}"))
    return table.select(columns) if columns else table


def _renamed_columns(names: list[str]) -> str | None:
    """Why a part whose footer names a column no batchjob version writes, in place of one it lacks, is damaged:
    the footer carries no checksum, and a flipped byte in a column's name would otherwise read that column back as
    nulls (a column an older part lacks is read as nulls too). An added column alone is left to whoever added it."""
    unknown = sorted(set(names) - set(SCHEMA.names))
    missing = [n for n in SCHEMA.names if n not in names]
    if unknown and missing:
        return (f"its footer names column(s) {', '.join(map(repr, unknown))} where {', '.join(map(repr, missing))} "
                "belong(s): the footer is damaged")
    return None


def read_conformed(file: pq.ParquetFile, schema: pa.Schema) -> pa.Table:
    """One Parquet file as a table of `schema`: its columns cast, a column older files lack as nulls. Read with
    the plain file reader on this thread, not `pq.read_table`: that goes through the dataset scanner, whose
    thread-pool callbacks were seen to abort a process (SIGABRT inside Arrow's Acero) now and then."""
    table = file.read(use_threads=False)
    columns = [table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(len(table), f.type)
               for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def _reason(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _manifest_config(directory: Path) -> str | None:
    """The config file named in the output's manifest (for the fix in messages), if readable."""
    try:
        return json.loads((directory / MANIFEST).read_text())["config"]["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def scan_output(directory: Path, columns: list[str] | None = None) -> tuple[pa.Table | None, list[DamagedPart]]:
    """Every complete part read and verified: the readable rows (None when there are no parts) and the damaged
    parts. Each part is read whole (that is what verifies it) and only `columns` are kept."""
    tables, damaged = [], []
    for part in complete_parts(directory):
        try:
            tables.append(read_part(part, columns))
        except PartUnreadable as err:
            damaged.append(err.damaged)
    if not tables:
        return None, damaged
    return pa.concat_tables(tables), damaged


def read_verified(directory: Path, columns: list[str] | None = None, config: str | None = None) -> pa.Table | None:
    """The output's rows (None without parts); OutputDamaged when any part cannot be read back (its fix names
    `config`, default the config the output's manifest names)."""
    table, damaged = scan_output(directory, columns)
    if damaged:
        raise OutputDamaged(directory, damaged, config or _manifest_config(directory))
    return table


def done_row_ids(directory: Path) -> set[str]:
    """Row ids already answered (every part verified)."""
    table = read_verified(directory, ["row_id"])
    return set(table.column("row_id").to_pylist()) if table is not None else set()


def quarantine_damaged(directory: Path) -> list[DamagedPart]:
    """`run --repair`: move each damaged part to `_damaged/` (named `*.damaged`, so no reader's glob takes it);
    its rows are then missing from the output and the run answers them again."""
    _, damaged = scan_output(directory, ["row_id"])
    if not damaged:
        return []
    folder = directory / DAMAGED
    folder.mkdir(exist_ok=True)
    for d in damaged:
        target, n = folder / f"{d.path.name}.damaged", 1
        while target.exists():
            target, n = folder / f"{d.path.name}.{n}.damaged", n + 1
        os.replace(d.path, target)
    _fsync_dir(directory)
    return damaged


def fingerprint_conflict(directory: Path, fingerprint: str) -> str | None:
    """Why this config must not write into `directory` (another config's results), or None. A manifest
    without parts (a run refused, or one whose engine failed to load, before any row) holds no results:
    a corrected config takes the directory over."""
    parts = complete_parts(directory)
    if not parts:
        return None
    old = _stored_fingerprint(directory, parts)
    if old is not None and old != fingerprint:
        return (f"{directory} holds results of another config (fingerprint {old}, this config is "
                f"{fingerprint}): model, prompt, loader or frames changed. Use --restart to discard them, or "
                "--output to write elsewhere.")
    if old is None:
        return (f"{directory} has part files but no {MANIFEST}; not a batchjob output of this job. "
                "Use --restart to discard them, or --output to write elsewhere.")
    return None


def _stored_fingerprint(directory: Path, parts: list[Path]) -> str | None:
    """From the manifest; when that is unreadable, from the newest readable part's metadata (same value)."""
    try:
        fp = json.loads((directory / MANIFEST).read_text()).get("fingerprint")
        if fp is not None:
            return fp
    except FileNotFoundError:
        pass
    except (OSError, ValueError, AttributeError):
        for part in reversed(parts):
            try:
                meta = pq.read_schema(part).metadata or {}
                return json.loads(meta[METADATA_KEY]).get("fingerprint")
            except (pa.ArrowException, OSError, ValueError, KeyError):
                continue
    return None


@dataclass(frozen=True)
class PreparedOutput:
    existing: pa.Table | None          # the rows already in the output (the columns asked for); None: no parts
    moved: tuple[DamagedPart, ...]     # damaged parts `repair` moved to _damaged/


def prepare_output(directory: Path, fingerprint: str, manifest: dict[str, Any], *, restart: bool,
                   repair: bool = False, columns: list[str] | None = None) -> PreparedOutput:
    """Make `directory` ready for this job and read back (verified) what it already holds.

    Refuses (OutputMismatch) to mix results of another fingerprint unless `restart`, which deletes the
    old parts, and (OutputDamaged) to resume over parts that cannot be read back unless `repair`.
    Leftover temporaries of a killed run are removed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for tmp in directory.glob("*.tmp"):      # `.part-*.tmp` and the `part-*.parquet.tmp` of older versions
        tmp.unlink()
    if restart:
        for p in complete_parts(directory):
            p.unlink()
    else:
        conflict = fingerprint_conflict(directory, fingerprint)
        if conflict:
            raise OutputMismatch(conflict)
    moved = quarantine_damaged(directory) if repair else []
    config = (manifest.get("config") or {}).get("source")
    existing = read_verified(directory, columns or ["row_id"], config)    # OutputDamaged names every damaged part
    atomic_write_bytes(directory / MANIFEST, json.dumps({**manifest, "fingerprint": fingerprint}, indent=2).encode())
    return PreparedOutput(existing, tuple(moved))


def rewrite_parts(directory: Path, change: Callable[[list[dict[str, Any]]], tuple[list[dict[str, Any]], int]]) -> int:
    """Apply `change` (rows -> rows, how many changed) to every part, replacing each changed part atomically
    under its own name: a reader sees each part either before or after, and each row exactly once."""
    changed = 0
    for part in complete_parts(directory):
        meta = pq.read_schema(part).metadata
        rows, n = change(read_part(part).to_pylist())
        if n:
            write_part(part, pa.Table.from_pylist(rows, schema=SCHEMA).replace_schema_metadata(meta))
            changed += n
    return changed


class PartWriter:
    """Buffers result rows and writes them as numbered part files, atomically.

    A part is written when `rows_per_part` rows are buffered or `flush_seconds` passed since the last
    write, so a crash loses at most that much finished work (which the rerun redoes).
    """

    def __init__(self, directory: Path, file_metadata: dict[str, Any], rows_per_part: int, flush_seconds: float,
                 suffix: str = ".parquet"):
        self.directory = directory
        self.rows_per_part = rows_per_part
        self.flush_seconds = flush_seconds
        self.suffix = suffix
        self._meta = {METADATA_KEY: json.dumps(file_metadata, default=str).encode()}
        existing = [int(p.name[len("part-"):].split(".")[0]) for p in complete_parts(directory, suffix)]
        self._next = max(existing, default=-1) + 1
        self._buffer: list[dict[str, Any]] = []
        self._last_write = time.monotonic()

    def add(self, rows: list[dict[str, Any]]) -> None:
        self._buffer.extend(rows)
        if len(self._buffer) >= self.rows_per_part:
            self.flush()

    def maybe_flush(self) -> None:
        if self._buffer and time.monotonic() - self._last_write >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        while self._buffer:
            chunk, self._buffer = self._buffer[: self.rows_per_part], self._buffer[self.rows_per_part:]
            table = pa.Table.from_pylist(chunk, schema=SCHEMA).replace_schema_metadata(self._meta)
            write_part(self.directory / f"part-{self._next:05d}{self.suffix}", table)
            self._next += 1
        self._last_write = time.monotonic()


def read_output(directory: str | Path) -> pa.Table:
    """The whole job output as one table (complete parts, verified); OutputDamaged names unreadable parts."""
    directory = Path(directory)
    table = read_verified(directory)
    if table is None:
        raise FileNotFoundError(f"{directory}: no part-*.parquet files (is this a batchjob output directory?)")
    return table


def read_file_metadata(directory: str | Path) -> dict[str, Any]:
    """Config, fingerprint and versions stored in the newest part's Parquet metadata (the newest whose
    metadata still reads: it is informational, and not covered by the page checksums)."""
    for part in reversed(complete_parts(Path(directory))):
        try:
            meta = pq.read_schema(part).metadata or {}
            return json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else {}
        except (pa.ArrowException, OSError, ValueError):
            continue
    return {}
