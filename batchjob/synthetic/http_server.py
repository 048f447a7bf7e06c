"""A static file server with HTTP Range support on 127.0.0.1, for tests and benchmarks of remote clips.

The standard library's `http.server` answers whole files only; this one answers `Range: bytes=a-b` (and `a-`,
`-n`) with 206, keeps connections alive (HTTP/1.1, as aiohttp expects), counts the body bytes it sends per path
(`TrafficLog`) and injects the faults a `FaultInjector` draws. Every stall is bounded (`stall_s`), every thread
is a daemon, and it binds loopback only.
"""
from __future__ import annotations

import hashlib
import os
import re
import socket
import struct
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from batchjob.synthetic.faults import FaultInjector, TrafficLog

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
CHUNK = 256 * 1024
_STATUS = {"5xx": HTTPStatus.SERVICE_UNAVAILABLE, "missing": HTTPStatus.NOT_FOUND, "denied": HTTPStatus.FORBIDDEN}


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """(start, end inclusive) for a single byte range, None when absent, "bad" when unsatisfiable."""
    if not header:
        return None
    m = _RANGE.match(header.strip())
    if not m or (not m.group(1) and not m.group(2)):
        return "bad"
    if not m.group(1):                      # suffix: the last n bytes
        n = int(m.group(2))
        return (max(0, size - n), size - 1) if n > 0 and size > 0 else "bad"
    start = int(m.group(1))
    end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
    return (start, end) if start <= end and start < size else "bad"


def drop_connection(sock: socket.socket) -> None:
    """Abort the TCP connection (RST where the OS allows), as a crashing proxy or a network fault does."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True   # headers and body go out as separate writes: no 40 ms delayed-ACK stall
    server: "RangeHTTPServer"

    def log_message(self, format, *args):  # noqa: A002 - quiet: tests read the TrafficLog, not stderr
        return

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        srv = self.server
        path = unquote(urlsplit(self.path).path)
        srv.log.request(path)
        fault = srv.faults.draw(path)
        if fault:
            srv.log.fault(path, fault)
        if fault == "timeout":
            time.sleep(srv.faults.stall_s)
            self.close_connection = True
            drop_connection(self.connection)
            return
        if fault in _STATUS:
            return self._status_only(_STATUS[fault])
        file = (srv.root / path.lstrip("/")).resolve()
        if srv.root not in file.parents or not file.is_file():
            return self._status_only(HTTPStatus.NOT_FOUND)
        size = file.stat().st_size
        wanted = None if srv.ignore_range else parse_range(self.headers.get("Range"), size)
        if wanted == "bad":
            self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, end = wanted if wanted else (0, size - 1)
        length = end - start + 1 if size else 0
        self.send_response(HTTPStatus.PARTIAL_CONTENT if wanted else HTTPStatus.OK)
        if wanted:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        stat = file.stat()
        self.send_header("ETag", '"' + hashlib.md5(f"{stat.st_mtime_ns}:{size}".encode()).hexdigest() + '"')
        self.send_header("Accept-Ranges", "none" if srv.ignore_range else "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if not body:
            return
        limit = length // 2 if fault == "reset" else length
        sent = 0
        with open(file, "rb") as fh:
            fh.seek(start)
            while sent < limit:
                chunk = fh.read(min(CHUNK, limit - sent))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                except OSError:        # the client gave up (its timeout): stop sending
                    self.close_connection = True
                    break
                sent += len(chunk)
                srv.log.sent(path, len(chunk))
        if fault == "reset":
            self.wfile.flush()
            self.close_connection = True
            drop_connection(self.connection)

    def _status_only(self, status: HTTPStatus) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()


class RangeHTTPServer(ThreadingHTTPServer):
    """Serves `root` on http://127.0.0.1:PORT/ (start() picks a free port); use as a context manager."""

    daemon_threads = True

    def __init__(self, root: str | os.PathLike, faults: FaultInjector | None = None, *, ignore_range: bool = False):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = Path(root).resolve()
        self.faults = faults or FaultInjector()
        self.log = TrafficLog()
        self.ignore_range = ignore_range
        self._thread: threading.Thread | None = None

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up (its timeout, a reset) is routine here; anything else is printed."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "RangeHTTPServer":
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "RangeHTTPServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
