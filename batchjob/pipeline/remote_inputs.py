"""A job's clips named by URLs: how its decoders read them, and whether their location answers before any work.

`check_dataset_location` is one of the preflight checks (`batchjob validate`, and `batchjob run` before Ray
starts): a wrong bucket, a missing permission or an unreachable server must cost a clear exit 2 in the first
seconds, not a night of error rows. It makes one listing of the video root (object stores), or, where listing
is not possible or not permitted, opens up to three clips (first, middle, last), and names the URL and the
permission that is missing.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from batchjob.config import ConfigError, JobConfig, RuntimeConfig
from batchjob.datasets import Row
from batchjob.location import is_remote, redact, scheme
from batchjob.loaders.errors import AccessDenied, LoaderError, VideoNotFound
from batchjob.loaders.transport import MiB, RemoteObject, RemoteOptions, Requester

# A clip's I/O must give up (with its own message) before the driver kills its decoder at decode_timeout_s.
IO_SHARE_OF_DECODE_TIMEOUT = 0.9
PROBE_CLIPS = 3


def remote_options(runtime: RuntimeConfig) -> RemoteOptions:
    r = runtime.remote
    max_ahead = int(r.max_read_ahead_mb * MiB)
    return RemoteOptions(attempts=r.attempts, request_timeout_s=r.request_timeout_s,
                         read_ahead_bytes=r.read_ahead_kb * 1024, max_read_ahead_bytes=max_ahead,
                         cache_bytes=max(32 * MiB, 8 * max_ahead), download_cache_bytes=int(r.download_cache_mb * MiB),
                         budget_s=IO_SHARE_OF_DECODE_TIMEOUT * runtime.decode_timeout_s)


def _probe_sample(videos: Sequence[str]) -> list[str]:
    distinct = list(dict.fromkeys(videos))
    picks = [distinct[0], distinct[len(distinct) // 2], distinct[-1]]
    return list(dict.fromkeys(picks))[:PROBE_CLIPS]


def check_dataset_location(cfg: JobConfig, rows: Sequence[Row]) -> None:
    """Raise ConfigError (exit 2) when the job's remote clips cannot be reached; nothing remote: no request."""
    videos = [r.video for r in rows if is_remote(r.video)]
    if not videos:
        return
    where = cfg.source or "config"
    root = cfg.dataset.video_root if is_remote(cfg.dataset.video_root) else None
    key = "dataset.video_root" if root else f"dataset.annotation ({cfg.dataset.annotation}: its video URLs)"
    # Preflight is interactive: fewer tries than a night's reads, no per-clip budget.
    options = dataclasses.replace(remote_options(cfg.runtime), attempts=min(2, cfg.runtime.remote.attempts),
                                  missing_attempts=1, budget_s=None)
    if root is not None and scheme(root) not in ("http", "https"):   # object stores: one listing of the root
        try:
            Requester(root, options).info("listing it")
            return
        except VideoNotFound:
            raise ConfigError(f"{where}: {key}: {redact(root)}: no such bucket, container or prefix; check the "
                              "name and the region or endpoint your storage SDK's config points at") from None
        except AccessDenied:
            pass      # reading may still be allowed without listing: the clips themselves tell
        except LoaderError as err:
            raise ConfigError(f"{where}: {key}: cannot reach {err}") from None
    missing = []
    for video in _probe_sample(videos):
        try:
            RemoteObject(video, options)
            return
        except VideoNotFound:
            missing.append(redact(video))
        except LoaderError as err:
            raise ConfigError(f"{where}: {key}: cannot read the clips: {err}") from None
    raise ConfigError(f"{where}: {key}: none of the clips probed exists ({', '.join(missing)}); check "
                      f"{'dataset.video_root' if root else 'the video URLs'} (the location answers, the clips are "
                      "not there)")
