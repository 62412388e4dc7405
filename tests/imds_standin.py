"""A local stand-in for the EC2 instance metadata service (IMDSv2), on 127.0.0.1.

It answers as the real one does: PUT /latest/api/token (with the TTL header) gives a
session token; GET /latest/meta-data/instance-type gives the type only with that token
(401 without it). Point the studio at it with AWS_EC2_METADATA_SERVICE_ENDPOINT.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "AQAEAstand-in-token=="


class ImdsStandIn:
    def __init__(self, instance_type: str):
        self.instance_type = instance_type
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.imds = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    def __enter__(self) -> ImdsStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _Handler(BaseHTTPRequestHandler):
    def _answer(self, status: int, body: str = "") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_PUT(self):
        self.server.imds.requests.append(("PUT", self.path))
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._answer(200, TOKEN)
        return self._answer(400 if self.path == "/latest/api/token" else 404)

    def do_GET(self):
        self.server.imds.requests.append(("GET", self.path))
        if self.path != "/latest/meta-data/instance-type":
            return self._answer(404)
        if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
            return self._answer(401)
        return self._answer(200, self.server.imds.instance_type)

    def log_message(self, format, *args):
        """Quiet: `requests` is the log."""
