"""Run backends: where a run's processes execute (base.py says what each one does).

`studio.run_on` in a spec names the backend; a run folder's launch.json says which one
started it: this machine (local.py), a Slurm cluster (slurm/) or a Ray cluster (ray/). A backend owns all of its
engine: what a user chooses for it (`options_type`, read from the recipe key studio.<name>), its
checks, its node-side part (`node`), its scripts and how its runs end. Nothing outside this
folder names an engine: it asks the registry below.
"""

from __future__ import annotations

from studio_core.backends.base import Ending, Node, RunBackend, StopError, SubmitError, option
from studio_core.backends.local import LocalBackend
from studio_core.backends.ray.backend import RayBackend
from studio_core.backends.slurm.backend import SlurmBackend

BACKENDS: dict[str, RunBackend] = {backend.name: backend for backend in (LocalBackend(), SlurmBackend(), RayBackend())}
DEFAULT = "local"
EXPORT = BACKENDS[SlurmBackend.name]  # whose batch script Export writes, for a run of its own


def get(name: str | None) -> RunBackend:
    """The backend called `name` (None: the default); KeyError naming the choices otherwise."""
    try:
        return BACKENDS[name or DEFAULT]
    except KeyError:
        raise KeyError(f"studio.run_on: {name!r} is not a place runs can execute here; choose "
                       f"{', '.join(BACKENDS)}") from None


def with_options() -> list[RunBackend]:
    """The backends a user chooses options for (each read from the recipe key studio.<name>)."""
    return [backend for backend in BACKENDS.values() if backend.options_type is not None]


def owner(options) -> RunBackend | None:
    """The backend whose options these are (None for None)."""
    return next((b for b in with_options() if isinstance(options, b.options_type)), None)


def read_options(studio: dict):
    """The options in a recipe's studio block (under studio.<backend name>): (options or None,
    problems: a block that is no mapping, unknown keys, options for two places)."""
    found = [(backend, studio[backend.name]) for backend in with_options() if backend.name in studio]
    if len(found) > 1:
        return None, [f"studio: options for {' and '.join(f'studio.{b.name}' for b, _ in found)}: keep only those "
                      "of studio.run_on"]
    if not found:
        return None, []
    backend, data = found[0]
    return backend.options_type.from_dict(data)


def check_layout(layout) -> list[str]:
    """The layout's rules that depend on where it runs, without asking the place: nodes only where
    a run may have several, options only for the place it runs on, the place's own rules."""
    backend = BACKENDS.get(layout.run_on) if isinstance(layout.run_on, str) else None
    if backend is None:
        return []  # an unknown place is said by the manager, with the choices
    problems = []
    if isinstance(layout.nodes, int) and backend.max_nodes is not None and layout.nodes > backend.max_nodes:
        clusters = " or ".join(b.name for b in BACKENDS.values() if b.max_nodes is None)
        problems.append(f"studio.nodes: {layout.nodes} nodes need a cluster: set studio.run_on: {clusters} (or "
                        f"nodes: 1 to run on {backend.description})")
    given = owner(layout.options)
    if given is not None and given is not backend and layout.options.to_dict():
        return problems + [f"studio.{given.name}: these settings are for studio.run_on: {given.name}, but the run is "
                           f"{layout.run_on}"]
    return problems + backend.layout_problems(layout)


__all__ = ["BACKENDS", "DEFAULT", "EXPORT", "Ending", "Node", "RunBackend", "StopError", "SubmitError", "check_layout", "get",
           "option", "owner", "read_options", "with_options"]
