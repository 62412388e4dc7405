"""The studio's own cache folder, which the built-in model, TRL's field schema, the config
checks, the compile cache and lm-eval's offline tasks live under."""

import contextlib
import fcntl
import os
import shutil
import tempfile
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


def build_atomically(root: Path, is_complete, build) -> Path:
    """Build into a temporary sibling of ``root`` and rename it into place, so concurrent
    callers (torchrun ranks, the page) never see a half-written folder; one process builds it
    (one_maker), the others wait and find it built."""
    with one_maker(root.name):
        if is_complete(root):
            return root
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
        try:
            build(tmp)
            try:
                os.rename(tmp, root)
            except OSError:
                # Another process renamed its build into place first: use theirs.
                if not is_complete(root):
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return root
