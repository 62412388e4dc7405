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


def collection_off() -> None:
    """Called next in a child that imports torch, Transformers or TRL (after skip_final_collection),
    and in the training worker: the cyclic garbage collector is off while the child imports them and
    loads what it needs, until set_up(). Its passes over the growing heap of those imports took about
    a fifth of their CPU (`from trl import SFTTrainer, SFTConfig; import peft, datasets`: 4.3-4.6 CPU-s
    with them, 3.5-3.7 without, on this 2-core machine), and the imports leave little that only a
    collection frees (one collection right after them found 9,794 unreachable objects of 460,534; the
    process's resident memory did not change)."""
    gc.disable()


def set_up() -> None:
    """The child has imported what it uses (and loaded its model): what is alive now is frozen, so
    that no later collection walks it again, and collection is on again for the work ahead. Every
    child that calls collection_off() calls this before its work (a long-lived one before it
    answers its first request): a process must not run long without the collector."""
    gc.freeze()
    gc.enable()


def _freeze_the_heap() -> None:
    gc.disable()
    gc.freeze()  # what is alive now goes to the permanent generation: no collection walks it again
