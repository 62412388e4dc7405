"""Where a run executes: the interface every run backend implements.

The run manager writes the run folder (spec.yaml, launch.json with the plan, events.jsonl)
and hands it to a backend, which starts the run's processes, says whether they are still
there, stops them, and says how a run ended when its processes are gone without a final
`status` event. Everything else (what the run reports, its checkpoints, stop and save,
resume) goes through the run folder, which every backend's processes write.

The planner asks the run's backend for the command that starts the processes
(`launch_argv`), so the plan shows exactly what runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path


class SubmitError(RuntimeError):
    """The place refused the run, or could not be reached; the message says what it said."""


@dataclass(frozen=True)
class Ending:
    """How a run ended that has no final status in its events: the state to show, and why."""

    state: str  # "failed" or "stopped"; "finished" when only the supervisor's own record says so
    reason: str


class RunBackend(ABC):
    name: str  # the value of the spec's studio.run_on
    description: str  # for people: where the run's processes execute
    local_cores: bool = True  # does a run hold cores of this machine (leased by the manager)?

    @abstractmethod
    def launch_argv(self, layout, module: str, run_dir: str) -> list[str]:
        """The command that starts the layout's processes of `module` on the run folder. Pure."""

    def planned(self, spec, hardware, env: dict, run_dir, compile_cache) -> tuple[list, list]:
        """What this backend adds to a plan: it may add to `env`; returns (applied, warnings),
        applied as (key, value, reason). Pure but for looking at where folders are."""
        return [], []

    def describe_launch(self, plan) -> list[str]:
        """Lines the plan's description adds for this backend (what it submits, and how)."""
        return []

    def check(self, layout) -> list[str]:
        """Problems only the place itself can tell (asked before anything is made)."""
        return []

    @abstractmethod
    def submit(self, run_dir: Path, launch, backend: str) -> None:
        """Start the run whose folder is written, as `launch` (its Plan) says; return once it holds
        its cores (on the hardware `backend`: neuron, cuda or cpu), is queued, or has ended trying."""

    def where(self, run_dir: Path, live: bool) -> str | None:
        """Where the run is, for people (a Slurm job's id; with `live`, its state and nodes now), or None."""
        return None

    @abstractmethod
    def alive(self, run_dir: Path) -> bool:
        """Are the run's processes (or what watches over them) still there?"""

    @abstractmethod
    def stop(self, run_dir: Path, grace_s: float) -> None:
        """Stop the run: ask its processes to end, wait up to `grace_s`, then end them. Returns
        when none is left (RuntimeError naming any that survived)."""

    @abstractmethod
    def ending(self, run_dir: Path, created: float) -> Ending | None:
        """For a run that is not alive and has no final status: how it ended, or None while it
        may still be starting (`created`: when its folder was made)."""
