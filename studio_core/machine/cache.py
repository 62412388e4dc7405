"""The studio's own cache folder, which the built-in model, TRL's field schema, the config
checks, the compile cache and lm-eval's offline tasks live under."""

import contextlib
import fcntl
import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of the studio's local cache (``$STUDIO_CACHE_DIR`` or ~/.cache/trn-studio)."""
    return Path(os.environ.get("STUDIO_CACHE_DIR", "~/.cache/trn-studio")).expanduser()


@contextlib.contextmanager
def one_maker(name: str):
    """Held by one process at a time, machine-wide (an flock on <cache>/locks/<name>): the maker of
    a cached thing holds it while it looks for the thing and makes it, so that processes starting
    together (a run's ranks, a test session's workers, a plan beside the page) make it once and the
    others wait, then find it made. The lock goes with the process, however it ends."""
    folder = cache_dir() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / name, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
