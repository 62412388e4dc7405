"""export: a finished run as a model folder with a card, and its push to the Hub (--push)."""

from __future__ import annotations

import sys

from studio_core import hub
from studio_core.export import ExportError, export_run
from studio_core.hardware import detect_hardware
from studio_core.runs.manager import RunManager


def cmd_export(args) -> int:
    manager = RunManager(args.runs_dir)
    try:
        token, source = hub.resolve_token(None) if args.push else (None, None)
        result = export_run(manager.runs_dir / args.run_id, args.out, merge=args.merge,
                            hardware=detect_hardware(), cores=args.cores)
    except (ExportError, hub.HubError) as error:
        print(f"Cannot export: {error}", file=sys.stderr)
        return 2
    print(f"Exported {result['kind']} model to {result['folder']}: {', '.join(result['files'])}")
    if not args.push:
        return 0
    try:
        url = hub.push(result["folder"], args.push, token, source, private=args.private, update=args.update)
    except hub.HubError as error:
        print(f"Push failed: {error}", file=sys.stderr)
        return 1
    print(f"Pushed ({'private' if args.private else 'public'}): {url}")
    return 0
