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
from dataclasses import dataclass, field, fields
from pathlib import Path

from studio_core.rundir import events
from studio_core.rundir.folder import EVENTS

# What each field of a backend's options dataclass carries in its `metadata` (see `option`), so
# that the command line and the form make their flag and widget from it, and say problems
# under the names the user typed them in:
#   "label"   the form's label, also the name problems are said under there ("Time limit")
#   "help"    one line for the flag's help and the widget's info
#   "flag"    the command line's option ("--time"); a "list" field's flag is repeated
#   "kind"    "text" (a string, None when not given), "bool" (a checkbox / store_true flag),
#             "list" (a list of strings: a repeated flag, one line split as a shell would)
#   "choices" None, or a function () -> (names, line) a form offers in a dropdown that takes
#             other values too (the cluster's partitions, and a line saying what they are)
#   "placeholder"  what an empty widget shows ("partition default"), or None
#   "offered" None, or a function () -> bool: may the form's widget be used here (HyperPod's
#             auto-resume only where srun has it)
#   "recipe"  what the recipe key holds, for the message naming the keys (an unknown key's)
# A form widget's elem_id is the field's name (the browser tests find widgets by it).
# An options dataclass has: from_dict(data) -> (options, problems) and to_dict() (the recipe's
# block: only what is not a default), check(labels=None) -> problems (under the recipe's keys,
# or under `labels`: a field's name -> the flag or widget it was typed in), and settled() -> the
# options as they are kept once the check passed (what the command line and the form store).
OPTION_KINDS = ("text", "bool", "list")


def option(default, *, label: str, help: str, flag: str, recipe: str, kind: str = "text", choices=None,
           placeholder: str | None = None, offered=None):
    """A field of a backend's options dataclass, with the metadata above. A list default is
    copied for each instance."""
    if kind not in OPTION_KINDS:
        raise ValueError(f"option kind {kind!r}: one of {OPTION_KINDS}")
    metadata = {"label": label, "help": help, "flag": flag, "kind": kind, "choices": choices,
                "placeholder": placeholder, "offered": offered, "recipe": recipe}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def options_from_dict(cls, key: str, data):
    """An options dataclass `cls` from a recipe's block under `key` (studio.slurm), and what the
    dataclass cannot hold (a block that is no mapping, an unknown key); a value of the wrong kind
    is kept, for the options' `check` to name."""
    keys = [f.name for f in fields(cls)]
    if not isinstance(data, dict):
        return cls(), [f"{key}: must be a mapping of " + ", ".join(keys)]
    takes = "; ".join(f"{f.name} ({f.metadata['recipe']})" for f in fields(cls))
    return cls(**{k: v for k, v in data.items() if k in keys}), [
        f"{key}.{name}: unknown key; it takes {takes}" for name in data if name not in keys]


def has_final_status(run_dir: Path) -> bool:
    """Do the run's events end in a final status (finished, failed, stopped)?"""
    return events.last_state(run_dir / EVENTS) in events.FINAL_STATES


def recorded(run_dir: Path, ending: Ending | None, to_write: list[dict]) -> Ending | None:
    """A cluster backend's `record_ending`: the events that record how the run ended, written into
    its events (none when they already say), and the ending."""
    for event in to_write:
        events.append(run_dir / EVENTS, event)
    return ending


class SubmitError(RuntimeError):
    """The place refused the run, or could not be reached; the message says what it said."""


class StopError(RuntimeError):
    """The place could not stop the run (it does not answer, or its processes outlived the stop);
    the message says what is known and what to do."""


@dataclass(frozen=True)
class Ending:
    """How a run ended that has no final status in its events: the state to show, and why."""

    state: str  # "failed" or "stopped"; "finished" when only the supervisor's own record says so
    reason: str


class Node(ABC):
    """One machine of a run that a place executes on several machines (a cluster job's node), as
    that machine's supervisor (studio_core.training.supervisor) sees it. The place, not the
    node, writes the final status of a run that failed or that the place ended."""

    name: str  # the node's name, for the events and its hardware samples
    first: bool  # the rendezvous host, and the node that says how the run ended
    task_marker: tuple[str, ...]  # environment variables whose values this node's processes share

    @abstractmethod
    def prepare(self, argv: list[str]) -> list[str]:
        """Put the rendezvous (where the first node listens) into this process's environment, and
        return the launch command with it filled in."""

    @abstractmethod
    def describe(self) -> str:
        """The log line the first node writes: where the run is and where its rendezvous is."""

    @abstractmethod
    def restart_from(self, env: dict) -> dict | None:
        """The checkpoint to go on from when the place restarted the run's step itself, else None."""

    @abstractmethod
    def started(self) -> None:
        """Record that this node's supervisor started (so a failure can be told to the node)."""

    @abstractmethod
    def ended(self, exit_code: int, stopped: bool) -> None:
        """Record this node's end: its torchrun's exit code, and whether a stop was asked."""

    @abstractmethod
    def left_to_place(self, exit_code: int, stopped: bool) -> str:
        """The first node's log line when the place writes the final status (a stop it sent, or a
        failure whose cause it knows: a node may have died)."""


class RunBackend(ABC):
    name: str  # the value of the spec's studio.run_on
    label: str  # its name for people: the form's "Run on" choice, the command line's group ("Slurm")
    description: str  # for people: where the run's processes execute
    local_cores: bool = True  # does a run hold cores of this machine (leased by the manager)?
    cluster: bool = False  # are its machines a cluster's nodes, which talk over the network?
    max_nodes: int | None = 1  # how many machines a run may have (None: as many as the place has)
    # The dataclass of what a user chooses for this place (None: nothing): read from the recipe
    # key studio.<name>, its fields made into flags and widgets (see `option`), with its own check.
    options_type: type | None = None
    # Several runs submitted as one (a sweep's runs): what the place calls such a group ("job
    # array"), or None when it takes its runs one by one. A place with groups says which runs
    # cannot be one (`group_problems`), submits them (`submit_group`) and itself runs at most
    # `parallel` of them at once.
    group: str | None = None

    def options(self, layout):
        """The layout's options for this backend (its defaults when the spec gives none), or None."""
        if self.options_type is None:
            return None
        return layout.options if isinstance(layout.options, self.options_type) else self.options_type()

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

    def layout_problems(self, layout) -> list[str]:
        """What is wrong with the layout for this place, without asking it (the spec's check)."""
        return []

    def check(self, layout, device: str) -> list[str]:
        """Problems only the place itself can tell (asked before anything is made), for a run on
        `device` (neuron, cuda, cpu)."""
        return []

    def export_script(self, plan) -> str:
        """The script that submits this plan as the studio would (Export writes it); ValueError
        for a place that takes no script."""
        raise ValueError(f"a batch script needs a plan for a cluster, not for {self.name!r}: plan it with "
                         "RunManager.export_plan")

    @abstractmethod
    def submit(self, run_dir: Path, launch, device: str) -> None:
        """Start the run whose folder is written, as `launch` (its Plan) says; return once it holds
        its cores (on the hardware `device`: neuron, cuda or cpu), is queued, or has ended trying."""

    def group_problems(self, plans: list) -> list[str]:
        """Why these planned runs cannot be submitted as one group ([] when they can)."""
        return []

    def submit_group(self, folder: Path, name: str, runs: list, parallel: int | None) -> str:
        """Submit the runs, each `(run folder, plan)` (folders written, nothing submitted), as one
        group, at most `parallel` of them at once; the group's own files go in `folder`, named after
        `name`. -> the group's id. SubmitError, saying what to do, when nothing was submitted."""
        raise SubmitError(f"{self.label} takes its runs one by one, not as one group: submit each on its own")

    def node(self, run_dir: Path, launch: dict) -> Node | None:
        """This machine as a node of the run (from launch.json and the place's environment), when
        the supervisor runs as one of several machines' supervisors; None on a run of one machine."""
        return None

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
        may still be starting (`created`: when its latest attempt began: its folder was made, or
        it was resumed). Reads only."""

    def record_ending(self, run_dir: Path, created: float) -> Ending | None:
        """`ending`, written into the run's events when the place would forget it (a cluster
        forgets ended jobs); the default has nothing to write."""
        return self.ending(run_dir, created)
