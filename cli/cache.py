"""cache: show the compile cache's folder, size and entries, or clear it."""

from __future__ import annotations

import sys

from cli.options import runs_folder
from studio_core.machine import compile_cache
from studio_core.machine.hardware import detect_hardware
from studio_core.runs.manager import RunManager


def cmd_cache(args) -> int:
    folder = compile_cache.compile_cache_dir(args.backend or detect_hardware().backend)
    if args.clear:
        try:
            compile_cache.clear(folder, RunManager(runs_folder(args)).active_runs())
        except compile_cache.CacheInUse as error:
            print(error, file=sys.stderr)
            return 2
        print(f"Cleared {folder}")
    print(compile_cache.summary(folder).describe())
    return 0
