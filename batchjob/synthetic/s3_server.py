"""An S3 API server on 127.0.0.1 (moto's server mode) that counts object bytes and injects faults.

moto's own `ThreadedMotoServer` serves its WSGI app as is; this wraps that app so every object request is logged
(`TrafficLog`: body bytes per path, as the server sends them) and may be answered with a fault (`FaultInjector`):
a stall, a 503 SlowDown, half a body then a dropped connection, or a 404 NoSuchKey. Requests for buckets
(listings) pass through untouched. moto is a test dependency (`pip install 'batchjob[test]'`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable
from urllib.parse import unquote

from batchjob.synthetic.faults import FaultInjector, TrafficLog
from batchjob.synthetic.http_server import drop_connection

_ERRORS = {
    "5xx": ("503 Service Unavailable", "SlowDown", "Please reduce your request rate."),
    "missing": ("404 Not Found", "NoSuchKey", "The specified key does not exist."),
    "denied": ("403 Forbidden", "AccessDenied", "Access Denied"),
}


class FaultyObjects:
    """WSGI middleware in front of moto: object requests (`/bucket/key...`) are counted and may fault."""

    def __init__(self, app: Callable, faults: FaultInjector, log: TrafficLog):
        self.app, self.faults, self.log = app, faults, log

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        path = unquote(environ.get("PATH_INFO", ""))
        method = environ.get("REQUEST_METHOD", "GET")
        is_object = path.count("/") >= 2 and not path.endswith("/") and method in ("GET", "HEAD")
        bucket = "/" + path.strip("/").split("/", 1)[0]
        if not is_object:   # bucket requests (listings) only take the faults queued for the bucket itself
            fault = self.faults.draw(bucket, at_random=False) if path.strip("/") and "/" not in path.strip("/") else None
            if fault in _ERRORS:
                self.log.fault(bucket, fault)
                return self._error(fault, path, method, start_response)
            return self.app(environ, start_response)
        self.log.request(path)
        fault = self.faults.draw(path)
        if fault:
            self.log.fault(path, fault)
        if fault == "timeout" or (fault == "reset" and method == "HEAD"):   # a HEAD has no body to cut short
            time.sleep(self.faults.stall_s if fault == "timeout" else 0)
            sock = environ.get("werkzeug.socket")
            if sock is not None:
                drop_connection(sock)
            raise ConnectionResetError(f"injected {fault}")
        if fault in _ERRORS:
            return self._error(fault, path, method, start_response)
        body = self.app(environ, start_response)
        if method != "GET":
            return body
        return self._counted(path, body, environ.get("werkzeug.socket") if fault == "reset" else None)

    @staticmethod
    def _error(fault: str, path: str, method: str, start_response: Callable) -> list[bytes]:
        status, code, message = _ERRORS[fault]
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
                f"<Resource>{path}</Resource></Error>").encode() if method == "GET" else b""
        start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
        return [body]

    def _counted(self, path: str, body: Iterable[bytes], drop) -> Iterable[bytes]:
        data = b"".join(body)
        if hasattr(body, "close"):
            body.close()
        limit = len(data) // 2 if drop is not None else len(data)
        step = 256 * 1024
        for start in range(0, limit, step):
            chunk = data[start:min(start + step, limit)]
            self.log.sent(path, len(chunk))
            yield chunk
        if drop is not None:
            drop_connection(drop)
            raise ConnectionResetError("injected reset")


class S3Server:
    """moto's S3 on http://127.0.0.1:PORT with faults and byte counts; use as a context manager."""

    def __init__(self, faults: FaultInjector | None = None):
        self.faults = faults or FaultInjector()
        self.log = TrafficLog()
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "S3Server":
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import WSGIRequestHandler, make_server

        class Quiet(WSGIRequestHandler):
            def log(self, *args, **kwargs):   # tests read the TrafficLog, not request lines
                return

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        app = FaultyObjects(DomainDispatcherApplication(create_backend_app), self.faults, self.log)
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=Quiet)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def environment(self) -> dict[str, str]:
        """The variables the AWS SDKs read to reach this server with dummy credentials (as a user's would)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1"}
