"""Where a clip or a dataset lives: a local path, or a URL that fsspec opens (s3://, gs://, az://, https://, file://).

Pure string logic, no I/O library imported, so the config, the dataset adapters and the loaders agree on what
a URL is, how a clip name joins a root, and what of a URL may be written to logs and output: credentials belong
to each SDK's environment and config files, never to a URL we keep.
"""
from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

# scheme -> the package fsspec needs for it (installed by the extra of the same name in pyproject.toml)
REMOTE_SCHEMES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                  "abfss": "adlfs", "http": "aiohttp", "https": "aiohttp"}
EXTRA_FOR_PACKAGE = {"s3fs": "s3", "gcsfs": "gcs", "adlfs": "azure", "aiohttp": "remote"}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
# Query parameters that carry a secret (presigned S3/GCS URLs, Azure SAS tokens, generic tokens).
_SECRET_PARAMS = re.compile(r"^(x-amz-(signature|credential|security-token)|x-goog-(signature|credential)|sig|"
                            r"signature|token|access_token)$", re.IGNORECASE)


class LocationError(ValueError):
    """A URL batchjob cannot use as written (unknown scheme, credentials inside it)."""


def scheme(location: str) -> str | None:
    """The URL scheme in lower case (`s3`, `https`, ...), or None for a local path (Windows drives included)."""
    m = _SCHEME.match(location) if isinstance(location, str) else None
    return m.group(1).lower() if m else None


def is_url(location: object) -> bool:
    return isinstance(location, str) and scheme(location) is not None


def is_remote(location: object) -> bool:
    """A URL that is read over the network (file:// is a local path spelled as a URL)."""
    return isinstance(location, str) and scheme(location) in REMOTE_SCHEMES


def check_supported(url: str) -> None:
    """Raise LocationError for a scheme fsspec is not set up for here, or credentials written into the URL."""
    s = scheme(url)
    if s is not None and s != "file" and s not in REMOTE_SCHEMES:
        raise LocationError(f"{redact(url)}: unsupported URL scheme {s}://; use a local path or one of "
                            f"{', '.join(sorted({*REMOTE_SCHEMES, 'file'}))}")
    secret = credentials_in(url)
    if secret:
        raise LocationError(f"{redact(url)}: {secret}; leave credentials to the storage SDK's environment or "
                            "config files (AWS_PROFILE / ~/.aws, GOOGLE_APPLICATION_CREDENTIALS, "
                            "AZURE_STORAGE_* variables, ~/.netrc for HTTP), so they never reach configs or output")


def credentials_in(url: str) -> str | None:
    """Why `url` carries a secret (user:password, a signature or token in the query), or None."""
    if not is_url(url):
        return None
    parts = urlsplit(url)
    if parts.password is not None:
        return "the URL holds a password (user:password@host)"
    secret = [k for k, _ in parse_qsl(parts.query, keep_blank_values=True) if _SECRET_PARAMS.match(k)]
    if secret:
        return f"the URL's query holds credentials ({', '.join(sorted(set(secret)))})"
    return None


def redact(location: str) -> str:
    """`location` safe to log or store: no user info, no query string, no fragment."""
    if not is_url(location):
        return location
    parts = urlsplit(location)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def local_path(url: str) -> str:
    """The path of a file:// URL (`file:///data/a.mp4` -> `/data/a.mp4`)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise LocationError(f"{url}: a file:// URL names a file on this machine; drop the host {parts.netloc!r}")
    return unquote(parts.path)


def join(root: str, name: str) -> str:
    """`name` under `root`; a name that is already a URL or an absolute path stands alone.

    URLs join with `/` whatever the machine (object keys are not OS paths); local roots join as paths.
    """
    if is_url(name):
        return name
    if is_url(root):
        if name.startswith("/"):
            return name
        return root.rstrip("/") + "/" + name
    from pathlib import Path

    return str(Path(root) / name)


def name_of(location: str) -> str:
    """The last component (a clip's file name), for URLs and paths alike."""
    path = urlsplit(location).path if is_url(location) else location.replace("\\", "/")
    return path.rstrip("/").rsplit("/", 1)[-1]
