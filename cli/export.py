"""export: a finished run as a model folder with a card, and its push to the Hub (--push)."""

from __future__ import annotations

import sys

from cli.options import CommandLineError, check_new_folder, check_one_core, runs_folder
from studio_core.export.export import ExportError, check_out, export_run
from studio_core.machine.hardware import detect_hardware
from studio_core.runs.manager import RunManager


def cmd_export(args) -> int:
    from studio_core.export import hub  # huggingface_hub's client: only when exporting, not in every command

    check_push_options(args)
    if not args.out.strip():
        raise CommandLineError("--out is empty: give a folder (a new or empty one) for the export")
    manager = RunManager(runs_folder(args, write=True))
    run_dir = manager.view(args.run_id).dir  # a run of that id, before anything slow
    out = check_new_folder("--out", args.out)
    try:
        check_out(run_dir, out)
    except ExportError as error:
        raise CommandLineError(f"--out {error}") from None
    try:
        token, source = hub.resolve_token(None, can_type=False) if args.push else (None, None)
        hardware = detect_hardware()
        if hardware.backend == "cpu":  # only there the export holds a core
            check_one_core(args.cores, hardware)
        result = export_run(run_dir, out, merge=args.merge, hardware=hardware, cores=args.cores)
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


def check_push_options(args) -> None:
    """--push's repo id (as hub.push checks it, but before the export), and its companions."""
    if not args.push:
        given = [option for option, on in (("--public", not args.private), ("--update", args.update)) if on]
        if given:
            raise CommandLineError(f"{', '.join(given)}: these go with --push REPO_ID: add it, or leave them out")
        return
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(args.push.strip())
    except HFValidationError as error:
        raise CommandLineError(f"--push {args.push!r}: {error} (write it as your-name/model-name)") from None
    if "/" not in args.push:
        raise CommandLineError(f"--push {args.push!r}: write it as your-name/{args.push} or an-org/{args.push}")
