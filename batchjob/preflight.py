"""Every check that can run before any work, in one place: the config's inputs and outputs, the loader's
keywords, the engine's settings, the dataset, its clips, and what the output directory already holds.

A bad night must fail in its first second with a message naming the key or file and the fix, never after
an hour of decoding or, worse, after the rows are written (a `--stats-json` path that cannot be written
used to cost the summary of a finished run). `batchjob run` and `batchjob schedule` refuse (exit 2) on what
these checks find; `batchjob validate` runs them all and also reports what would only cost error rows
(missing clips) and what the run would refuse later (another config's output, damaged parts).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from batchjob.config import ConfigError, JobConfig
from batchjob.datasets import Row, load_rows
from batchjob.location import is_url

FETCH_HINTS = {"nextqa": " (prepare it with scripts/prepare_nextqa.py)",
               "mvbench": " (prepare it with scripts/prepare_mvbench.py)",
               "manifest": " (a JSONL/CSV manifest: id, video, question, options[, answer, category]; "
                           "configs/demo.yaml is meant for `batchjob demo`, which builds its files)"}
SHOWN = 5          # missing clips named in a message


def _where(cfg: JobConfig) -> str:
    return cfg.source or "config"


def check_inputs(cfg: JobConfig) -> None:
    """Every input the job reads must exist before Ray starts; the message says how to get it."""
    where, ds = _where(cfg), cfg.dataset
    fetch = FETCH_HINTS[ds.adapter]
    if not Path(ds.annotation).exists():
        raise ConfigError(f"{where}: dataset.annotation: file not found: {ds.annotation}{fetch}")
    if ds.video_root and not is_url(ds.video_root) and not Path(ds.video_root).is_dir():
        root_hint = fetch if ds.adapter != "manifest" else (
            " (the folder the manifest's `video` paths are relative to: check the path, and that its disk or "
            "share is mounted)")
        raise ConfigError(f"{where}: dataset.video_root: directory not found: {ds.video_root}{root_hint}")
    ckpt = cfg.model.checkpoint
    if Path(ckpt).is_absolute() and not Path(ckpt).is_dir():
        raise ConfigError(f"{where}: model.checkpoint: directory not found: {ckpt} "
                          "(a local Hugging Face checkpoint directory, or a hub id such as Qwen/Qwen2.5-VL-7B-Instruct)")
    if cfg.model.engine == "mlx" and Path(ckpt).is_absolute() and not (Path(ckpt) / "config.json").is_file():
        raise ConfigError(f"{where}: model.checkpoint: {ckpt} has no config.json; point it at a Hugging Face "
                          "checkpoint directory (the one holding config.json and *.safetensors)")


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_dir(path: str | Path, key: str) -> None:
    """A directory the job writes into: it is one, or can be created, and we may write there."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}: exists and is not a directory: {path}")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: directory not writable: {path} (check its permissions, or write elsewhere)")
        return
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise ConfigError(f"{key}: cannot create {path}: {base} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot create {path}: {base} is not writable")


def check_output_file(path: str | Path, flag: str, *, create_parents: bool = False) -> None:
    """A file written at the end of a command: its folder exists (or, with `create_parents`, can be made)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag}: {path} is a directory; name a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag}: {path} exists and is not writable")
    if create_parents:
        check_output_dir(path.parent, flag)
    elif not path.parent.is_dir():
        raise ConfigError(f"{flag}: directory {path.parent} does not exist (create it first, or name another "
                          "file)")
    elif not os.access(path.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}: directory {path.parent} is not writable")


def check_loader(cfg: JobConfig) -> None:
    """The loader exists and reads every keyword the config gives it."""
    from batchjob.loaders import get_loader, list_loaders
    from batchjob.loaders.registry import option_problems

    where, name = _where(cfg), cfg.loader.name
    if name not in list_loaders():
        raise ConfigError(f"{where}: loader.name: unknown loader {name!r}; valid: {', '.join(list_loaders())}")
    problems = option_problems(get_loader(name), cfg.loader.kwargs)
    if problems:
        raise ConfigError(f"{where}: loader.kwargs for {name!r}:\n" + "\n".join(f"  loader.kwargs.{p}"
                                                                               for p in problems)
                          + "\n(`batchjob loaders` lists each loader's keywords)")


def check_engine(cfg: JobConfig) -> None:
    """The engine's own checks; with the engines on this machine (no cluster), also against its devices."""
    from batchjob.pipeline.engines import resolve_engine
    from batchjob.pipeline.placement import choose_placement, local_gpu_count

    try:
        engine = resolve_engine(cfg.model.engine)
        choose_placement(cfg, local_gpu_count(), bool(getattr(engine, "runs_in_driver", False)))   # driver: possible?
        engine.check(cfg.model, cfg.prompt)
        if cfg.runtime.ray_address is None and hasattr(engine, "check_local"):
            engine.check_local(cfg.model)
    except ConfigError as err:
        raise ConfigError(f"{_where(cfg)}: {err}") from None


def preflight(cfg: JobConfig, *, output_key: str | None = None) -> list[Row]:
    """Everything about a job that can be checked without starting Ray; ConfigError (exit 2) names the key or
    file. `output_key` is how messages name the output directory (`--output` when the flag set it)."""
    check_loader(cfg)
    check_engine(cfg)
    check_inputs(cfg)
    check_output_dir(cfg.output.directory, output_key or f"{_where(cfg)}: output.directory")
    rows = load_rows(cfg.dataset)
    from batchjob.pipeline.remote_inputs import check_dataset_location

    check_dataset_location(cfg, rows)   # clips named by URLs: their location answers (one listing or HEAD)
    widest = max(len(r.options) for r in rows)
    if widest > len(cfg.prompt.option_labels):
        raise ConfigError(f"{_where(cfg)}: prompt.option_labels: {len(cfg.prompt.option_labels)} labels, but a "
                          f"question has {widest} options; add labels")
    return rows


@dataclass(frozen=True)
class MissingClips:
    """Clips of the dataset that are not on disk (local paths only): each costs its rows an error row."""
    clips: int                 # clips checked
    rows: int                  # rows checked
    missing: tuple[str, ...]   # missing clip paths, in dataset order
    missing_rows: int          # rows on those clips

    @property
    def all_missing(self) -> bool:
        return self.clips > 0 and len(self.missing) == self.clips

    def describe(self) -> str:
        first = ", ".join(self.missing[:SHOWN]) + (", ..." if len(self.missing) > SHOWN else "")
        return (f"{len(self.missing)} of {self.clips} clips not found ({self.missing_rows} of {self.rows} rows); "
                f"first: {first}")


def missing_clips(rows: Sequence[Row]) -> MissingClips:
    """Stat each local clip once. URLs are left to the loaders (reaching them is not a cheap check)."""
    exists: dict[str, bool] = {}
    local_rows = 0
    missing_rows = 0
    for r in rows:
        if "://" in r.video:
            continue
        local_rows += 1
        if r.video not in exists:
            exists[r.video] = os.path.isfile(r.video)
        missing_rows += not exists[r.video]
    missing = tuple(v for v, ok in exists.items() if not ok)
    return MissingClips(len(exists), local_rows, missing, missing_rows)


def refuse_if_no_clip_exists(cfg: JobConfig, to_decode: Sequence[Row], rows: Sequence[Row]) -> None:
    """A run that would only write error rows because none of the dataset's clips is there (a wrong video_root,
    an unmounted share) stops instead. A few clips that are really gone still become error rows (retried by
    `--retry-errors`, night after night if need be) as long as any clip of the dataset exists."""
    missing = missing_clips(to_decode)
    if not missing.all_missing:
        return
    known = set(missing.missing)
    others = {r.video for r in rows if "://" not in r.video and r.video not in known}
    if any(os.path.isfile(v) for v in others):
        return
    root = cfg.dataset.video_root or str(Path(cfg.dataset.annotation).parent)
    raise ConfigError(f"{_where(cfg)}: none of the dataset's clips exists ({missing.describe()}); check "
                      f"dataset.video_root ({root}) and that its disk or share is mounted")


def output_problems(cfg: JobConfig) -> list[str]:
    """What `run` would refuse about the existing output (read only): another config's results, damaged parts."""
    from batchjob.pipeline.output import OutputDamaged, fingerprint_conflict, read_verified

    out = Path(cfg.output.directory)
    if not out.is_dir():
        return []
    problems = []
    conflict = fingerprint_conflict(out, cfg.fingerprint())
    if conflict:
        problems.append(conflict)
    try:
        read_verified(out, ["row_id"], cfg.source)
    except OutputDamaged as err:
        problems.append(str(err))
    return problems


def error_budget_problem(cfg: JobConfig, missing: MissingClips) -> str | None:
    """The run would exit 1 for its error rows alone: the missing clips exceed runtime.max_error_fraction."""
    if not missing.rows or not missing.missing:
        return None
    frac = missing.missing_rows / missing.rows
    if frac <= cfg.runtime.max_error_fraction:
        return None
    return (f"{frac:.1%} of the rows are on missing clips, above runtime.max_error_fraction "
            f"{cfg.runtime.max_error_fraction:.1%}: the run would fail (exit 1)")
