"""An S3 endpoint that ignores If-None-Match makes exclusive creation last-writer-wins, silently: the store is
probed once in preflight and refused, with the fix. The endpoint here is moto's server behind a proxy on
127.0.0.1 that drops the header, as such an endpoint would."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import pytest

from forge_core.storage import ObjectStore

pytestmark = pytest.mark.integration


def header_dropping_proxy(upstream: str) -> ThreadingHTTPServer:
    """An HTTP proxy on 127.0.0.1 to `upstream` that forwards every request without its If-None-Match."""
    target = urlparse(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # answers botocore's "Expect: 100-continue" before it sends a body

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("if-none-match", "expect")}
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
            conn.request(self.command, self.path, body=body, headers=headers)
            reply = conn.getresponse()
            data = reply.read()
            self.send_response(reply.status)
            for name, value in reply.getheaders():
                if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        def log_message(self, *args) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.fault(
    fault="an S3 endpoint that ignores If-None-Match (moto behind a proxy that drops the header)",
    where="preflight (forgeflow validate, every flow start): ObjectStore.conditional_write_problem",
    checked="the store is refused, naming storage.root, the endpoint and the fix; moto itself passes the probe",
)
def test_an_endpoint_that_ignores_if_none_match_is_refused(s3_store, fault_row):
    assert s3_store.conditional_write_problem() is None
    proxy = header_dropping_proxy(s3_store.endpoint_url)
    try:
        endpoint = f"http://127.0.0.1:{proxy.server_address[1]}"
        behind = ObjectStore(s3_store.root, endpoint_url=endpoint)
        problem = behind.conditional_write_problem()
    finally:
        proxy.shutdown()
    assert problem is not None and "ignored If-None-Match" in problem and endpoint in problem, problem
    assert "storage.root=" in problem
    fault_row.fact("moto: no problem; behind the proxy: refused")
