"""The only exceptions loaders raise for bad input.

The pipeline turns a `LoaderError` into an error row and moves on to the next clip, so every failure a
user's file can cause must arrive as one of these, naming the file (or a short description of the bytes)
and what to do about it. Anything else escaping a loader is a bug in batchjob.

They are `ValueError`s because that is what vLLM's own loaders raise for bad media and what `vllm serve`
answers with HTTP 400 (a client error) instead of 500.
"""

from __future__ import annotations


class LoaderError(ValueError):
    """A clip could not be turned into frames. `str(err)` names the source and the reason."""

    def __init__(self, source: str, reason: str):
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason

    def __reduce__(self):  # keep (source, reason) across process boundaries (Ray actors pickle errors)
        return (type(self), (self.source, self.reason))


class VideoNotFound(LoaderError):
    """The path does not exist or cannot be read."""


class UnsupportedMedia(LoaderError):
    """The input is not a video FFmpeg can demux: text, a still image, audio only, unknown container."""


class CorruptVideo(LoaderError):
    """The container opened but its packets or pictures are damaged or truncated."""


class MissingTimestamps(CorruptVideo):
    """Packets carry no presentation timestamps, so frames cannot be placed on the clip's timeline."""


class InvalidArgument(LoaderError):
    """The caller asked for something impossible (num_frames <= 0, unknown backend, bad source type)."""


class RemoteReadError(LoaderError):
    """Reading a remote clip failed after the bounded retries (timeouts, server errors, dropped connections),
    or was refused (access denied). The message names the URL, the cause and how many attempts were made."""


class AccessDenied(RemoteReadError):
    """The store refused the request (a missing permission, no credentials): retrying cannot help."""
