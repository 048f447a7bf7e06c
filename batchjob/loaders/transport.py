"""Byte ranges of a remote object through fsspec: bounded retries with backoff, a timeout on every request, a
deadline for the whole clip, and a count of the bytes that came over the network.

Every request goes through `RemoteObject._attempt`, so no fault (a server that stalls, answers 5xx, drops the
connection mid-body, or loses the object) can make a read wait longer than the attempts and timeouts allow,
and the one that finally gives up says which URL, what went wrong and how often it was tried. Credentials come
from each SDK's own environment and config files: fsspec builds the filesystem from the URL's scheme alone
(plus fsspec's own config, `~/.config/fsspec` and `FSSPEC_<PROTOCOL>_<OPTION>` variables).
"""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import random
import time
from typing import Any, Callable

from batchjob.location import EXTRA_FOR_PACKAGE, REMOTE_SCHEMES, LocationError, check_supported, redact, scheme
from batchjob.loaders.errors import AccessDenied, InvalidArgument, LoaderError, RemoteReadError, VideoNotFound

MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class RemoteOptions:
    """How remote clips are read (one value per job; it crosses into the decode actors)."""

    attempts: int = 4                    # tries per request for transient faults (timeouts, 5xx, dropped links)
    missing_attempts: int = 2            # tries before a missing object counts as missing (stale caches/proxies)
    request_timeout_s: float = 20.0      # one request, connection to last byte
    backoff_s: float = 0.25              # first pause between tries; doubles, with jitter
    max_backoff_s: float = 4.0
    read_ahead_bytes: int = 64 * 1024    # fetched after a seek: a keyframe's packet plus what follows it
    max_read_ahead_bytes: int = 4 * MiB  # read-ahead doubles per sequential read up to this (demux sweeps)
    cache_bytes: int = 32 * MiB          # fetched ranges kept per open clip
    download_cache_bytes: int = 4096 * MiB  # local copies for loaders that need a file (opencv), per process
    budget_s: float | None = None        # a clip's whole I/O, from its opening; None: only attempts x timeout

    def __post_init__(self):
        if self.attempts < 1 or self.missing_attempts < 1:
            raise ValueError("attempts and missing_attempts must be >= 1")
        if self.request_timeout_s <= 0 or (self.budget_s is not None and self.budget_s <= 0):
            raise ValueError("request_timeout_s and budget_s must be > 0")
        if not 0 < self.read_ahead_bytes <= self.max_read_ahead_bytes <= self.cache_bytes:
            raise ValueError("need 0 < read_ahead_bytes <= max_read_ahead_bytes <= cache_bytes")


@dataclasses.dataclass
class FetchCounter:
    """What reading one clip cost on the network (only completed responses count their bytes)."""

    bytes: int = 0
    requests: int = 0
    retries: int = 0

    def as_metadata(self, object_bytes: int) -> dict[str, int]:
        return {"fetched_bytes": self.bytes, "fetch_requests": self.requests, "fetch_retries": self.retries,
                "object_bytes": object_bytes}


# Exceptions named by class (aiohttp, botocore and the cloud SDKs need not be importable here).
_CREDENTIAL_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                      "DefaultCredentialsError", "ClientAuthenticationError", "RefreshError"}
_DENIED_STATUS = {401, 403}
_RETRY_STATUS = {408, 425, 429}


@dataclasses.dataclass(frozen=True)
class Failure:
    kind: str    # "missing" | "denied" | "fatal" | "transient"
    text: str


def _status(err: BaseException) -> int | None:
    """The HTTP status behind an exception (aiohttp's `.status`, botocore's response), cause chain included."""
    seen = 0
    while err is not None and seen < 8:
        status = getattr(err, "status", None)
        if isinstance(status, int) and 100 <= status <= 599:
            return status
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(code, int):
                return code
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def classify(err: BaseException, timeout_s: float) -> Failure:
    """What a failed request means for retrying it, in words a user can act on."""
    names = {c.__name__ for c in type(err).__mro__}
    detail = f"{type(err).__name__}: {err}".strip().rstrip(":")
    if names & _CREDENTIAL_ERRORS:
        return Failure("denied", f"no usable credentials ({detail})")
    if isinstance(err, RangeIgnored):
        return Failure("fatal", str(err))
    status = _status(err)
    if isinstance(err, FileNotFoundError) or status == 404:
        return Failure("missing", "no such object")
    if isinstance(err, PermissionError) or status in _DENIED_STATUS:
        return Failure("denied", f"access denied ({detail})")
    if status is not None and (status >= 500 or status in _RETRY_STATUS):
        return Failure("transient", f"server error HTTP {status}")
    if status is not None and 400 <= status < 500:
        return Failure("fatal", f"request refused with HTTP {status} ({detail})")
    if isinstance(err, (TimeoutError, asyncio.TimeoutError)) or any("Timeout" in n for n in names):
        return Failure("transient", f"timed out (no complete answer within {timeout_s:g} s)")
    if isinstance(err, OSError) and err.errno in (errno.EREMOTEIO, errno.EBUSY):   # s3fs: 500 / 503 SlowDown
        return Failure("transient", f"server error ({detail})")
    return Failure("transient", f"connection failed or dropped mid-transfer ({detail})")


class RangeIgnored(Exception):
    """The server answered a byte-range request with more bytes than asked (it ignores `Range`)."""


_FILESYSTEMS: dict[tuple[str, str], Any] = {}


def reset_filesystems() -> None:
    """Forget the filesystems made so far (after the SDK's environment changed: credentials, endpoint)."""
    _FILESYSTEMS.clear()


def filesystem(url: str):
    """(fsspec filesystem, path) for `url`; a missing SDK package is named with the extra that installs it."""
    try:
        check_supported(url)
    except LocationError as err:
        raise InvalidArgument(redact(url), str(err).split(": ", 1)[-1]) from None
    try:
        import fsspec.config
        import fsspec.core
    except ImportError:
        raise InvalidArgument(redact(url), "reading URLs needs fsspec: pip install 'batchjob[remote]'") from None
    try:
        s = scheme(url) or ""
        options = fsspec.get_filesystem_class(s)._get_kwargs_from_urls(url)
        key = (s, repr(sorted(options.items())))
        fs = _FILESYSTEMS.get(key)
        if fs is None and s in ("s3", "s3a"):
            # one retry policy, ours (`attempts`): botocore's own retries of 5xx would multiply it
            site = fsspec.config.conf.get(s, {}).get("config_kwargs", {})   # keep a site's fsspec config
            options = {**options, "config_kwargs": {**site, "retries": {"total_max_attempts": 1}}}
        if fs is None:
            # Our own instance, not fsspec's shared one, so that turning its retries off touches nobody else's
            fs = _FILESYSTEMS[key] = fsspec.filesystem(s, skip_instance_cache=True, **options)
            if isinstance(getattr(type(fs), "retries", None), int):
                fs.retries = 1   # s3fs retries dropped connections itself: under ours that multiplies requests
        return fs, fs._strip_protocol(url)
    except ImportError as err:
        package = REMOTE_SCHEMES.get(scheme(url) or "", "")
        extra = EXTRA_FOR_PACKAGE.get(package, "remote")
        raise InvalidArgument(redact(url), f"reading {scheme(url)}:// URLs needs {package or 'an fsspec backend'} "
                                           f"({err}); pip install 'batchjob[{extra}]'") from None


class Requester:
    """Requests about one URL: each bounded by a timeout, retried as the options allow, counted."""

    def __init__(self, url: str, options: RemoteOptions | None = None, *, deadline: float | None = None):
        self.url, self.label = url, redact(url)
        self.options = options or RemoteOptions()
        budget = self.options.budget_s
        self.deadline = deadline if deadline is not None else (
            time.monotonic() + budget if budget is not None else None)
        self.counter = FetchCounter()
        self.fs, self.path = filesystem(url)

    @staticmethod
    def _call(fs, method: str, timeout: float, *args, **kwargs) -> Any:
        """One request with a hard timeout: async filesystems cancel it, which frees the connection too."""
        if getattr(fs, "async_impl", False):
            from fsspec.asyn import sync

            return sync(fs.loop, getattr(fs, "_" + method), *args, timeout=timeout, **kwargs)
        return getattr(fs, method)(*args, **kwargs)

    def info(self, what: str = "looking it up") -> dict[str, Any]:
        return self._attempt(what, lambda fs, t: self._call(fs, "info", t, self.path))

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def _attempt(self, what: str, call: Callable[[Any, float], Any]) -> Any:
        """`call(fs, timeout)` until it succeeds, a failure is final, or the tries or the clip's budget run out."""
        opts, tries = self.options, 0
        while True:
            left = self.remaining_s()
            if left is not None and left <= 0:
                raise RemoteReadError(self.label, f"gave up {what}: the clip's I/O budget of {opts.budget_s:g} s "
                                                  "(runtime.decode_timeout_s) ran out")
            timeout = opts.request_timeout_s if left is None else min(opts.request_timeout_s, left)
            tries += 1
            self.counter.requests += 1
            try:
                return call(self.fs, timeout)
            except LoaderError:
                raise
            except Exception as err:  # noqa: BLE001 - every transport error is classified, none escapes raw
                failure = classify(err, timeout)
            limit = {"missing": opts.missing_attempts, "transient": opts.attempts}.get(failure.kind, 1)
            if tries >= limit:
                raise self._final(failure, what, tries)
            pause = min(opts.max_backoff_s, opts.backoff_s * 2 ** (tries - 1)) * random.uniform(0.5, 1.0)
            left = self.remaining_s()
            if left is not None and pause >= left:
                raise RemoteReadError(self.label, f"gave up {what} after {tries} attempt(s): {failure.text}; the "
                                                  f"clip's I/O budget of {opts.budget_s:g} s ran out")
            self.counter.retries += 1
            time.sleep(pause)

    def _final(self, failure: Failure, what: str, tries: int) -> LoaderError:
        attempts = f"{tries} attempt{'s' if tries > 1 else ''}"
        if failure.kind == "missing":
            return VideoNotFound(self.label, f"no such object ({attempts}); check dataset.video_root and the "
                                             "manifest's video names")
        if failure.kind == "denied":
            return AccessDenied(self.label, f"{failure.text} while {what}; reading a clip needs read permission "
                                            f"on the object ({permission_hint(self.url)})")
        return RemoteReadError(self.label, f"failed {what} after {attempts}: {failure.text}")


class RemoteObject(Requester):
    """One remote object opened for ranged reads; `counter` says what reading it cost."""

    def __init__(self, url: str, options: RemoteOptions | None = None, *, deadline: float | None = None):
        super().__init__(url, options, deadline=deadline)
        self.head = b""   # the object's first bytes, when opening it already fetched them
        if scheme(url) in ("http", "https"):
            info = self._attempt("opening it", self._http_open)
            self.counter.bytes += len(self.head)
        else:
            info = self.info()
        size = info.get("size")
        if info.get("type") == "directory":
            raise VideoNotFound(self.label, "is a directory (a prefix), not a video object")
        if not isinstance(size, int):
            raise RemoteReadError(self.label, "the server does not report the object's size (no Content-Length), "
                                              "which ranged reads need; serve it with a size or copy it locally")
        self.size = size
        self.version = str(next((info[k] for k in ("ETag", "etag", "LastModified", "last_modified", "mtime")
                                 if info.get(k) is not None), ""))

    def _http_open(self, fs, timeout: float) -> dict[str, Any]:
        """One ranged GET for the first `read_ahead_bytes`: its Content-Range gives the size, so no HEAD is needed
        (presigned URLs are often signed for GET alone), and a server that ignores Range is caught before it
        sends a byte of body. (fsspec's own lookup falls back to an unranged GET of the whole file.)"""
        want = self.options.read_ahead_bytes

        async def go() -> dict[str, Any]:
            session = await fs.set_session()
            headers = {**fs.kwargs.get("headers", {}), "Range": f"bytes=0-{want - 1}", "Accept-Encoding": "identity"}
            kwargs = {k: v for k, v in fs.kwargs.items() if k != "headers"}
            async with session.get(fs.encode_url(self.path), headers=headers, **kwargs) as r:
                if r.status == 416:                      # an empty object has no byte 0
                    return {"size": 0, "ETag": r.headers.get("ETag")}
                if r.status == 404:
                    raise FileNotFoundError(self.label)
                r.raise_for_status()
                total = r.headers.get("Content-Range", "").rpartition("/")[2]
                if r.status != 206 or not total.isdigit():
                    raise RangeIgnored(f"the server answered a byte-range request with HTTP {r.status} and no "
                                       "Content-Range (no Range support); serve the clips from a server that "
                                       "honours Range")
                body = await r.read()
                if len(body) != min(want, int(total)):
                    raise ConnectionError(f"short read: {len(body)} of {min(want, int(total))} bytes")
                self.head = body
                return {"size": int(total), "ETag": r.headers.get("ETag") or r.headers.get("Last-Modified")}

        from fsspec.asyn import sync

        return sync(fs.loop, go, timeout=timeout)

    def fetch(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object (end clipped to its size); retried as the options allow."""
        end = min(end, self.size)
        if start >= end:
            return b""

        def get(fs, timeout: float) -> bytes:
            data = self._call(fs, "cat_file", timeout, self.path, start=start, end=end)
            if len(data) > end - start:
                raise RangeIgnored(f"the server ignored the byte range {start}-{end - 1} and sent {len(data)} bytes "
                                   "(no HTTP Range support); serve the clips from a server that honours Range")
            if len(data) < end - start:
                raise ConnectionError(f"short read: {len(data)} of {end - start} bytes")
            return data

        data = self._attempt(f"reading bytes {start}-{end - 1}", get)
        self.counter.bytes += len(data)
        return data


def permission_hint(url: str) -> str:
    """The permission a clip's read needs, in the store's own words."""
    s = scheme(url) or ""
    if s in ("s3", "s3a"):
        return "s3:GetObject; s3:ListBucket too to list the prefix or tell a missing key from a denied one"
    if s in ("gs", "gcs"):
        return "storage.objects.get; storage.objects.list to list the prefix (role Storage Object Viewer)"
    if s in ("az", "abfs", "abfss"):
        return "the Storage Blob Data Reader role (blob read and list) on the container"
    return "the server refused the request: check the credentials in ~/.netrc or the server's access rules"
