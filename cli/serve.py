"""serve: the web app, local-only unless a login is given."""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path


def cmd_serve(args) -> int:
    auth = read_auth(args)
    if not is_loopback(args.host) and not auth:
        print(f"Refusing to listen on {args.host}: anyone who can reach it could train and read your "
              "runs. Add --auth user:password (or --auth-file FILE), or keep the default 127.0.0.1.",
              file=sys.stderr)
        return 2
    from app.main import CSS, build_app, queued

    demo = build_app(args.runs_dir)
    print(f"Studio on http://{args.host}:{args.port}", flush=True)
    queued(demo).launch(server_name=args.host, server_port=args.port, auth=auth, show_error=True,
                        quiet=True, css=CSS,
                        footer_links=["gradio", "settings"])
    return 0


def read_auth(args) -> list[tuple[str, str]] | None:
    lines = []
    if args.auth:
        lines.append(args.auth)
    if args.auth_file:
        lines += [line.strip() for line in Path(args.auth_file).read_text().splitlines() if line.strip()]
    pairs = [tuple(line.split(":", 1)) for line in lines]
    if any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise SystemExit("--auth / --auth-file: write each login as user:password")
    return pairs or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
