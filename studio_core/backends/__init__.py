"""Run backends: where a run's processes execute (base.py says what each one does).

`studio.run_on` in a spec names the backend; a run folder's launch.json says which one
started it: this machine (local.py) or a Slurm cluster (slurm/).
"""

from __future__ import annotations

from studio_core.backends.base import Ending, RunBackend, SubmitError
from studio_core.backends.local import LocalBackend
from studio_core.backends.slurm.backend import SlurmBackend

BACKENDS: dict[str, RunBackend] = {backend.name: backend for backend in (LocalBackend(), SlurmBackend())}
DEFAULT = "local"


def get(name: str | None) -> RunBackend:
    """The backend called `name` (None: the default); KeyError naming the choices otherwise."""
    try:
        return BACKENDS[name or DEFAULT]
    except KeyError:
        raise KeyError(f"studio.run_on: {name!r} is not a place runs can execute here; choose "
                       f"{', '.join(BACKENDS)}") from None


__all__ = ["BACKENDS", "DEFAULT", "Ending", "RunBackend", "SubmitError", "get"]
