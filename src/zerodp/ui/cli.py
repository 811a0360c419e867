"""``zerodp ui``: serve the interactive calculators on this machine and print their address."""

from __future__ import annotations

import argparse
import sys
import webbrowser

from zerodp.ui.server import is_loopback, make_server


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ui", help="interactive calculators in the browser (memory, bucket overlap, roofline, batch, "
              "recommend)",
        description="Serve the guide's calculators as a local web page. Every figure on the page "
                    "comes from zerodp.plan, the same code as 'zerodp plan'.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--open", dest="open_browser", action=argparse.BooleanOptionalAction,
                   default=False, help="open the page in the default browser")
    p.add_argument("--profile", metavar="FILE",
                   help="calibration profile from 'zerodp calibrate': adds its hardware to every panel")
    p.add_argument("--trace", metavar="FILE",
                   help="Chrome trace from 'zerodp train --trace': drawn next to the simulated timeline")
    p.add_argument("--verbose", action="store_true", help="log every request")
    p.set_defaults(func=run)
    return p


def _open(url: str) -> bool:
    """Open ``url`` in the default browser: False when Python finds none (a server, a container)."""
    try:
        webbrowser.get()
    except webbrowser.Error:
        return False
    return bool(webbrowser.open(url))


def run(args) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    try:
        server = make_server(args.host, args.port, args.profile, args.trace, quiet=not args.verbose)
    except FileNotFoundError:  # a missing --profile/--trace or plotly: its own message
        raise
    except OSError as exc:
        raise ValueError(f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); "
                         "try another --port, or --port 0 for a free one") from None
    print(f"zerodp ui: serving on {server.url}  (Ctrl-C to stop)", flush=True)
    if not is_loopback(args.host):
        print(f"zerodp ui: warning: listening on {args.host}, not only on this machine: anyone "
              "who can reach it can use the page (it only reads; requests must name an IP "
              "address or this machine's name). Use --host 127.0.0.1 to keep it local.",
              file=sys.stderr, flush=True)
    if args.open_browser and not _open(server.url):
        print(f"zerodp ui: no web browser found to open; open {server.url} yourself",
              file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("zerodp ui: stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
