"""The local web server of ``zerodp ui``: one page, its static files, plotly.js, and the JSON API.

Routes (GET only):

* ``/`` — the page (``static/index.html``); ``/static/<file>`` — its script and style;
* ``/plotly.min.js`` — the chart library, served from the installed ``plotly`` Python package,
  so the page loads nothing from the internet;
* ``/api/<endpoint>?name=value&...`` — :mod:`zerodp.ui.api`; 200 with JSON, 422 with
  ``{"error", "error_zh", "field", "expected"}`` for bad input, 404 for an unknown endpoint. The
  page sends ``X-Zerodp-Page: 1`` and then gets the same error object with status 200 and
  ``"status": 422`` inside: for the page a refused value is an answer to show next to its field,
  and a browser logs every 4xx response as a console error. Each answer carries
  ``Server-Timing: app;dur=<ms>, cpu;dur=<ms>``: the wall and CPU time it took.

A Content-Security-Policy of ``'self'`` tells the browser to refuse anything from elsewhere. A
request whose ``Host`` header names another machine is refused (403): a web page elsewhere cannot
reach this server through a name it points at 127.0.0.1 (DNS rebinding). Accepted: IP addresses,
``localhost``, the name given to ``--host`` and, when bound beyond loopback, this machine's name.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from zerodp.ui.api import Api
from zerodp.ui.measured import Measured
from zerodp.ui.params import ApiError

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".woff2": "font/woff2", ".txt": "text/plain; charset=utf-8",
          ".json": "application/json; charset=utf-8"}
# plotly injects <style> elements and uses inline style attributes; everything else is 'self'
CSP = ("default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'")


def plotly_js_path() -> str:
    """The plotly.js bundle that ships inside the ``plotly`` Python package."""
    try:
        import plotly
    except ImportError:
        raise FileNotFoundError("the plotly package is missing: pip install plotly") from None
    path = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: reinstall plotly (pip install --force-reinstall plotly)")
    return path


class Handler(BaseHTTPRequestHandler):
    """Serves one request; the :class:`Api` and the quiet flag live on the server."""

    server: "UiServer"
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self._timing = None
        host = self.headers.get("Host")
        if not self.server.host_allowed(host):
            return self._json(HTTPStatus.FORBIDDEN, {
                "error": f"Host {host!r} is not this server's address: open {self.server.url} "
                         "(requests through other names are refused, against DNS rebinding)"})
        url = urlsplit(self.path)
        if url.path.startswith("/api/"):
            return self._api(url.path[len("/api/"):], url.query)
        if url.path in ("/", "/index.html"):
            return self._file(os.path.join(STATIC_DIR, "index.html"))
        if url.path == "/plotly.min.js":
            return self._file(self.server.plotly_path, cache=True)
        if url.path.startswith("/static/"):
            name = url.path[len("/static/"):]
            if name in self.server.static_files:  # a fixed list: no path can escape the folder
                return self._file(os.path.join(STATIC_DIR, name))
        self._json(HTTPStatus.NOT_FOUND, {"error": f"not found: {url.path}"})

    def _api(self, name: str, query: str):
        # what answering took: wall time and this thread's CPU time (Server-Timing header)
        self._timing = (time.perf_counter(), time.thread_time())
        try:
            raw = parse_qs(query, keep_blank_values=True, strict_parsing=False)
        except ValueError as exc:
            return self._json(HTTPStatus.BAD_REQUEST, {"error": f"bad query string: {exc}"})
        page = self.headers.get("X-Zerodp-Page") == "1"

        def refuse(err: ApiError):
            if page:  # the same object; the status inside, so the browser logs no error
                return self._json(HTTPStatus.OK, dict(err.to_dict(), status=422))
            return self._json(HTTPStatus.UNPROCESSABLE_ENTITY, err.to_dict())

        repeated = sorted(k for k, v in raw.items() if len(v) > 1)
        if repeated:
            return refuse(ApiError(repeated[0], f"{repeated[0]} given {len(raw[repeated[0]])} "
                                   "times: give it once", "one value",
                                   f"{repeated[0]} 出现了 {len(raw[repeated[0]])} 次：只给一次"))
        try:
            body = self.server.api.handle(name, {k: v[0] for k, v in raw.items()})
        except KeyError:
            names = ", ".join(self.server.api.endpoints())
            return self._json(HTTPStatus.NOT_FOUND, {"error": f"no endpoint {name!r}; endpoints: {names}"})
        except ApiError as exc:
            return refuse(exc)
        except Exception as exc:  # a bug: say so in JSON rather than drop the connection
            return self._json(HTTPStatus.INTERNAL_SERVER_ERROR,
                              {"error": f"internal error: {type(exc).__name__}: {exc}"})
        self._json(HTTPStatus.OK, body)

    def send_error(self, code, message=None, explain=None):  # noqa: D401 (http.server's name)
        """http.server's own refusals (a request line over 64 kB, a malformed request) in JSON."""
        phrase = message or HTTPStatus(code).phrase
        text = f"{code} {phrase}"
        if code == HTTPStatus.REQUEST_URI_TOO_LONG:
            text += ": the request line is over 65,536 bytes (a config.json is a few kB)"
        body = json.dumps({"error": text}).encode()
        self.send_response(code, phrase)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send(self, status: int, body: bytes, content_type: str, cache: bool = False):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        if getattr(self, "_timing", None):
            wall, cpu = time.perf_counter() - self._timing[0], time.thread_time() - self._timing[1]
            self.send_header("Server-Timing", f"app;dur={wall * 1e3:.2f}, cpu;dur={cpu * 1e3:.2f}")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj):
        body = json.dumps(obj, allow_nan=False).encode()
        self._send(status, body, "application/json")

    def _file(self, path: str, cache: bool = False):
        with open(path, "rb") as f:
            body = f.read()
        self._send(HTTPStatus.OK, body, _TYPES.get(os.path.splitext(path)[1], "application/octet-stream"),
                   cache)

    def log_message(self, format, *args):  # noqa: A002 (http.server's signature)
        if not self.server.quiet:
            super().log_message(format, *args)


class UiServer(ThreadingHTTPServer):
    """A threading HTTP server that carries the :class:`Api` its handlers answer with."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], api: Api, quiet: bool = True):
        self.bound_host = address[0]
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.api = api
        self.quiet = quiet
        self.plotly_path = plotly_js_path()
        self.static_files = frozenset(os.listdir(STATIC_DIR))
        super().__init__(address, Handler)

    def handle_error(self, request, client_address):
        """A client that went away mid-answer (a closed tab, a test's browser, a reload) is not
        an error of the server: no traceback for it; anything else is printed as usual."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)):
            return
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}/"

    def host_allowed(self, header: str | None) -> bool:
        """Whether a request's ``Host`` header addresses this server (module docstring)."""
        if not header:
            return False
        name = header.strip().lower()
        if name.startswith("["):  # [::1]:8765
            name = name[1:].split("]", 1)[0]
        elif name.count(":") == 1:
            name = name.rsplit(":", 1)[0]
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        return name in self.allowed_names

    @property
    def allowed_names(self) -> set[str]:
        names = {"localhost", str(self.bound_host).lower()}
        if not is_loopback(self.bound_host):
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        return names


def is_loopback(host: str) -> bool:
    """127.0.0.1, ::1 or localhost: only this machine can connect."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_server(host: str = "127.0.0.1", port: int = 0, profile: str | None = None,
                trace: str | None = None, quiet: bool = True) -> UiServer:
    """A bound, not yet serving server; ``port=0`` picks a free port (see ``server.url``)."""
    return UiServer((host, port), Api(Measured.load(profile, trace)), quiet=quiet)


def serve_in_thread(server: UiServer) -> threading.Thread:
    """Run ``server`` in a daemon thread (tests); stop it with ``server.shutdown()``."""
    thread = threading.Thread(target=server.serve_forever, name="zerodp-ui", daemon=True)
    thread.start()
    return thread
