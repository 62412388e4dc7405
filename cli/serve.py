"""serve: the web app, local-only unless a login is given."""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

from cli.options import CommandLineError, runs_folder


def cmd_serve(args) -> int:
    auth = read_auth(args)
    if not is_loopback(args.host) and not auth:
        print(f"Refusing to listen on {args.host}: anyone who can reach it could train and read your "
              "runs. Add --auth user:password (or --auth-file FILE), or keep the default 127.0.0.1.",
              file=sys.stderr)
        return 2
    runs_dir = runs_folder(args, write=True)  # before the app starts: it makes runs there
    from app.main import build_app, launch_settings, queued

    demo = build_app(runs_dir)
    print(f"Studio on http://{args.host}:{args.port}", flush=True)
    queued(demo).launch(server_name=args.host, server_port=args.port, auth=auth, show_error=True,
                        quiet=True, footer_links=["gradio", "settings"], **launch_settings(runs_dir))
    return 0


def read_auth(args) -> list[tuple[str, str]] | None:
    lines = []
    if args.auth:
        lines.append(args.auth)
    if args.auth_file:
        try:
            text = Path(args.auth_file).read_text()
        except (OSError, UnicodeDecodeError) as error:
            why = getattr(error, "strerror", None) or "not UTF-8 text"
            raise CommandLineError(f"--auth-file {args.auth_file}: cannot read it ({why}): give a text file "
                                   "with one user:password per line") from None
        found = [line.strip() for line in text.splitlines() if line.strip()]
        if not found:
            raise CommandLineError(f"--auth-file {args.auth_file} holds no login: write one user:password per line")
        lines += found
    pairs = [tuple(line.split(":", 1)) for line in lines]
    if any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise CommandLineError("--auth / --auth-file: write each login as user:password")
    return pairs or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
