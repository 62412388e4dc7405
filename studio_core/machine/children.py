"""Starting the studio's own child Python processes: the run supervisor, the chat process,
the export, the shape forecast, the reward check.

Each runs one of our modules (`python -m studio_core.X`), so it needs this repository on
its PYTHONPATH wherever it is started from. The repository is put in front of the user's
own PYTHONPATH, never in its place: a user who has set one keeps it in every child.
"""

from __future__ import annotations

import atexit
import gc
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def environment(added: dict[str, str] | None = None, without: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment with `added` on top and the variables `without` left out.
    PYTHONPATH is joined, not replaced: `added`'s own entries (the planner gives the
    repository), then the inherited ones."""
    added = dict(added or {})
    paths = [added.pop("PYTHONPATH", str(REPO_ROOT)), os.environ.get("PYTHONPATH", "")]
    env = {key: value for key, value in {**os.environ, **added}.items() if key not in without}
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for part in paths for p in part.split(os.pathsep) if p))
    return env


def module_argv(module: str, *args: object) -> list[str]:
    """The command line that runs one of our modules with this Python."""
    return [sys.executable, "-m", module, *map(str, args)]


def run(module: str, *args: object, env: dict[str, str] | None = None, **popen) -> subprocess.CompletedProcess:
    """Run `python -m module args...` to its end (subprocess.run's keywords pass through)."""
    return subprocess.run(module_argv(module, *args), env=environment(env), **popen)


def start(module: str, *args: object, env: dict[str, str] | None = None, without: tuple[str, ...] = (),
          **popen) -> subprocess.Popen:
    """Start `python -m module args...` and return at once (Popen's keywords pass through)."""
    return subprocess.Popen(module_argv(module, *args), env=environment(env, without), **popen)


def skip_final_collection() -> None:
    """Called first thing in a child that loads torch and Transformers (model and config checks,
    chat, evaluation, export) and in the command line: when it exits, after every atexit handler,
    the interpreter's last garbage collection is skipped. That pass walks the whole heap those
    libraries built, about 0.9 s of CPU per process here, for a process that is ending. Every atexit
    handler still runs and stdout and stderr are still flushed; objects still alive then are not
    finalized (their __del__ does not run, which Python never promises at exit), so each child writes,
    flushes and closes what it reports before it returns, as the training worker already does (it
    ends with os._exit). Registered first, it runs last: atexit runs its handlers in reverse order."""
    atexit.register(_freeze_the_heap)


def _freeze_the_heap() -> None:
    gc.disable()
    gc.freeze()  # what is alive now goes to the permanent generation: no collection walks it again
