"""Starting the studio's own child Python processes: the run supervisor, the chat process,
the export, the shape forecast, the reward check.

Each runs one of our modules (`python -m studio_core.X`), so it needs this repository on
its PYTHONPATH wherever it is started from. The repository is put in front of the user's
own PYTHONPATH, never in its place: a user who has set one keeps it in every child.
"""

from __future__ import annotations

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
