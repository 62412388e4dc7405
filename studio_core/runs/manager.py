"""The run manager: checks a spec, picks its cores, plans it, writes its run folder and hands
it to a run backend; lists, follows, stops and resumes runs. It starts no process itself:
the run's backend (studio_core.backends, chosen by the spec's studio.run_on) does.

A spec is checked once, before anything is locked: the checks may fetch a model's
config.json from the Hub, read a whole dataset file and run the reward functions in a child
process. The machine-wide start lock is held only to pick free cores and hand them to the
process that will hold them, so one slow check never holds up another start, a chat, an
export or a delete.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from studio_core import backends
from studio_core.machine import leases
from studio_core.machine.leases import LeaseFolderError  # for the CLI: a lease folder that cannot be made
from studio_core.data import sources
from studio_core.rundir.checkpoints import RESUME_ENV, clear_control, list_checkpoints, request_save_and_stop
from studio_core.machine.compile_cache import compile_cache_root
from studio_core.machine.cores import format_cores, parse_cores
from studio_core.machine.hardware import Hardware
from studio_core.runs import queue
from studio_core.training.memory import MEMORY_ERROR
from studio_core.backends import forking
from studio_core.training.plan import Plan, plan, prepare_trl_check, trl_problems
from studio_core.rundir import events, folder
from studio_core.rundir.events import ACTIVE_STATES, FINAL_STATES
from studio_core.runs.view import RunView
from studio_core.recipe.spec import RunSpec, SpecError, load_spec, with_absolute_paths
from studio_core.recipe.validate import validated

DEFAULT_RUNS_DIR = "~/trn-studio/runs"
WAIT_POLL_S = 0.2


class RunNotFound(KeyError):
    """No run of that id in the runs folder; the message names both."""


def default_runs_dir() -> Path:
    return Path(os.environ.get("STUDIO_RUNS_DIR", DEFAULT_RUNS_DIR)).expanduser()


class RunManager:
    def __init__(self, runs_dir: str | Path | None = None):
        self.runs_dir = Path(runs_dir).expanduser() if runs_dir else default_runs_dir()
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self._views: dict[str, RunView] = {}
        self._lock = threading.Lock()  # the web app reads runs from several threads

    @staticmethod
    def fork_runs_from_a_zygote(ignored: tuple[str, ...] = ()) -> None:
        """For a process that starts one run after another (the web app): from its first one-process
        run on this machine's CPU on, the next such runs are forked from a process that has imported
        torch and TRL once (studio_core/backends/forking.py). `ignored`: variables of this process that
        change from run to run and that no library reads."""
        forking.keep_zygote(ignored)

    # --- checking and planning ---------------------------------------------------------
    def check(self, spec: RunSpec, run_user_code: bool = False, warnings: list[str] | None = None,
              elsewhere: bool = False, hardware: Hardware | None = None) -> RunSpec:
        """The spec checked (SpecError with every problem), with local paths made absolute
        (the run's processes start in the run folder). A user's reward files are imported and
        called only with `run_user_code` (Start does; a plan or a preview only reads them).
        Warnings about the data go to `warnings`; `elsewhere`: a plan for another machine, which
        does not fetch or check a Hub model or dataset this machine does not have."""
        early = (lambda checked: prepare_trl_check(checked, hardware)) if hardware is not None else None
        spec = with_absolute_paths(validated(spec, run_user_code, warnings, elsewhere, early))
        try:
            backends.get(spec.layout.run_on)
        except KeyError as error:
            raise SpecError([str(error).strip("'\"")]) from None
        problems = trl_problems(spec, hardware) if hardware is not None else []  # TRL's own, with the plan's defaults
        if problems:
            raise SpecError(problems)
        return spec

    @staticmethod
    def memory(spec: RunSpec, hardware: Hardware, cores: list[int] | None = None) -> tuple:
        """The plan's device memory per core (training/memory.py's Estimate) and its refusal, if
        any, without the spec's slower checks: what the Train tab draws under its core map."""
        launch = plan(spec, hardware, cores, model_config=sources.model_config(spec.model_name_or_path))
        return launch.memory, [error for error in launch.errors if error.startswith(MEMORY_ERROR)]

    def plan(self, spec: RunSpec, hardware: Hardware, this_machine: bool = False, elsewhere: bool = False,
             queue_if_busy: bool = False) -> Plan:
        """The plan of a launch, the spec checked first. With `this_machine` (a preview of Start
        here, now) the cores are the ones Start would take at this moment: the asked-for ones if
        free (else SpecError naming their holder; with `queue_if_busy` a plan that says Start
        queues the run), or the next free block. With `elsewhere` (a
        plan for another machine: --instance, "Plan for") a Hub model or dataset this machine
        does not have is neither fetched nor checked; a warning says so."""
        data_warnings: list[str] = []
        spec = self.check(spec, warnings=data_warnings, elsewhere=elsewhere, hardware=hardware)
        this_machine = this_machine and backends.get(spec.layout.run_on).local_cores
        cores = (self.choose_cores(spec, hardware, wait=queue_if_busy, warnings=data_warnings) if this_machine
                 else parse_cores(spec.layout.cores) if spec.layout.cores else None)
        launch = self._plan(spec, hardware, cores, warnings=data_warnings)
        if this_machine and cores is None:
            holders = "; ".join(sorted(set(self.core_holders(hardware).values())))
            launch.warnings.insert(0, f"its cores are busy now (held by {holders}): Start queues the run, which "
                                      "starts when they are free")
        elif this_machine and not launch.errors:
            launch.applied.insert(0, ("studio.cores", format_cores(cores), "free on this machine now; Start takes "
                                      "the cores that are free when it is clicked (next free, when none are named)"))
        return launch

    def export_plan(self, spec: RunSpec, hardware: Hardware, nodes: int | None = None,
                    elsewhere: bool = False) -> Plan:
        """The plan of a batch script exported for a new run of this runs folder: the spec on the
        cluster whose script Export writes (backends.EXPORT), on `nodes` nodes (default: the spec's
        own there, else 2), for a run id chosen now. It is the plan Start would submit (the same
        environment: on Neuron the EFA variables), so its script (scripts.submit_script) is the one
        the studio submits; started by plain `sbatch`, the job makes the run folder itself and this
        runs folder lists it like any run."""
        cluster = backends.EXPORT
        on_it = spec.layout.run_on == cluster.name
        nodes = nodes if nodes is not None else (spec.layout.nodes if on_it else 2)
        # a node is the job's alone: cores named for this machine mean nothing there
        spec = replace(spec, layout=replace(spec.layout, run_on=cluster.name, nodes=nodes, cores=None))
        data_warnings: list[str] = []
        spec = self.check(spec, warnings=data_warnings, elsewhere=elsewhere, hardware=hardware)
        launch = self._plan(spec, hardware, None, folder.new_run_id(self.runs_dir, spec.display_name), data_warnings)
        if launch.errors:
            raise SpecError(launch.errors)
        return launch

    def _plan(self, spec: RunSpec, hardware: Hardware, cores: list[int] | None, run_id: str = "<run id>",
              warnings: list[str] = ()) -> Plan:
        """The plan, with `warnings` about the data (the check's) among its own."""
        launch = plan(spec, hardware, cores=cores, run_dir=self.runs_dir / run_id, run_id=run_id,
                      compile_cache=compile_cache_root(), model_config=sources.model_config(spec.model_name_or_path))
        launch.warnings += warnings
        return launch

    # --- starting ----------------------------------------------------------------------
    def start(self, spec: RunSpec, hardware: Hardware, planned: Callable[[Plan], None] | None = None,
              queue_if_busy: bool = False, hold: dict | None = None, submit: bool = True) -> RunView:
        """Check, pick cores, plan, write the run folder, hand it to the spec's backend.
        Raises SpecError (naming the holder when a core is taken, or what the cluster refused);
        nothing is left behind then. With `queue_if_busy`, a run whose cores are busy is queued
        instead (runs/queue.py: it starts when they are free, its turn come); a `hold` (a sweep's:
        queue.held_back) queues it also while the hold says wait. `planned` is shown the plan (its
        warnings: the data check's among them) once it is made, before anything runs. A run on a
        cluster with `submit` False gets its folder, not its job: the caller submits it (a sweep's
        Slurm job array)."""
        data_warnings: list[str] = []
        # before the lock: the slow part
        spec = self.check(spec, run_user_code=True, warnings=data_warnings, hardware=hardware)
        backend = self._ready(spec, hardware.backend)
        run_id = folder.new_run_id(self.runs_dir, spec.display_name)
        if not backend.local_cores:  # the cluster picks the nodes: no core of this machine is held
            launch = self._plan(spec, hardware, None, run_id, data_warnings)
            if launch.errors:
                raise SpecError(launch.errors)
            if planned is not None:
                planned(launch)
            run_dir = self._create(run_id, launch)
            if not submit:
                return self.view(run_id)
            try:
                backend.submit(run_dir, launch, device=hardware.backend)
            except backends.SubmitError as error:
                shutil.rmtree(run_dir, ignore_errors=True)
                raise SpecError([f"not submitted: {error}"]) from error
            return self._started(run_id)
        with leases.choosing(self.runs_dir):  # until the run's process holds the cores chosen here
            cores = self.choose_cores(spec, hardware, queue_if_busy, data_warnings)  # None: busy, it waits
            if hold and queue.held_back(hold, self.view_or_none):
                cores = None  # free or not, it waits for what its sweep holds it to
            launch = self._plan(spec, hardware, cores, run_id, data_warnings)
            if launch.errors:
                raise SpecError(launch.errors)
            if planned is not None:
                planned(launch)
            run_dir = self._create(run_id, launch, queued=cores is None, hold=hold)
            if cores is not None:
                backend.submit(run_dir, launch, device=hardware.backend)
        return self._started(run_id)

    def _started(self, run_id: str) -> RunView:
        """The run just started (or queued, or resumed); and a queue runner started when runs wait in
        the queue and none looks after them (the last one was killed, as by a reboot)."""
        queue.ensure_runner(self.runs_dir)
        return self.view(run_id)

    def start_queued(self) -> list[tuple[str, str | None]]:
        """Start the queued runs whose turn it is, on their cores if free (runs/queue.py): the first
        queued first; one whose cores are busy holds up the ones after it. -> (run id, None when
        started, else why it could not be: it ended as failed) for each run it took out of the queue."""
        done = []
        with leases.choosing(self.runs_dir):  # what it reads of a run's state holds until it is started
            for run_dir in queue.queued(self.runs_dir):
                try:
                    spec, queued_launch = load_spec(run_dir), folder.read_launch(run_dir)
                    hardware = Hardware(**queued_launch["hardware"])
                    if queue.held_back(queue.hold_of(run_dir), self.view_or_none):
                        break  # its sweep holds it (its precompile, --parallel): the runs after it wait too
                    resume = queue.resume_of(run_dir)
                    if resume:
                        spec = self._spec_to_resume(spec, hardware)
                        if not any(c["path"] == resume["path"] for c in list_checkpoints(run_dir)):
                            raise SpecError([f"its checkpoint at step {resume['step']} ({resume['path']}) is gone: "
                                             "resume it again, from a checkpoint it has"])
                    cores = self.choose_cores(spec, hardware, wait=True)
                    launch = None if cores is None else (
                        self._resume_plan(spec, hardware, cores, run_dir.name, resume, queued_launch) if resume
                        else self._plan(spec, hardware, cores, run_dir.name))
                    if launch is not None and launch.errors:
                        raise SpecError(launch.errors)
                except (SpecError, folder.DamagedRun, KeyError, TypeError) as error:
                    problem = f"could not start from the queue: {error}"
                    events.append(run_dir / folder.EVENTS, events.status("failed", reason=problem))
                    queue.leave(run_dir)
                    done.append((run_dir.name, problem))
                    continue
                if launch is None:
                    break  # its turn, but its cores are busy: the runs after it wait too
                if resume:
                    self._restart(run_dir, launch, resume)
                else:
                    folder.write_launch(run_dir, folder.launch_record(launch), created=queued_launch.get("created"))
                    events.append(run_dir / folder.EVENTS, events.status("starting"))
                queue.leave(run_dir)
                backends.get(spec.layout.run_on).submit(run_dir, launch, device=hardware.backend)
                done.append((run_dir.name, None))
        return done

    @staticmethod
    def _ready(spec: RunSpec, device: str) -> backends.RunBackend:
        """The spec's backend, once the place it runs accepts the layout (a cluster's partition,
        nodes and cores) for a run on `device`."""
        backend = backends.get(spec.layout.run_on)
        problems = backend.check(spec.layout, device)
        if problems:
            raise SpecError(problems)
        return backend

    def _create(self, run_id: str, launch: Plan, queued: bool = False, hold: dict | None = None) -> Path:
        """The run folder, made under a temporary name and renamed when whole: a listing never
        sees half a run. A `queued` one gets its place in the queue, last (with its `hold`)."""
        tmp = self.runs_dir / f"{folder.CREATING}{run_id}"
        tmp.mkdir()
        folder.write_new_run(tmp, launch.spec.to_yaml(), folder.launch_record(launch), created=time.time(),
                             state="queued" if queued else "starting")
        if queued:
            queue.enter(tmp, hold)
        run_dir = self.runs_dir / run_id
        tmp.rename(run_dir)
        return run_dir

    def resume(self, run_id: str, hardware: Hardware, step: int | None = None,
               queue_if_busy: bool = False) -> RunView:
        """Go on from the run's last checkpoint (or the one at `step`), in the same run folder:
        model, optimizer, scheduler and RNG states come back, the step count goes on, and the
        new events append to the run's own (after a `resume` event). It takes the run's cores, or
        the next free ones; with `queue_if_busy`, when none are free it waits in the queue
        (runs/queue.py) to resume from that checkpoint, and a cancel leaves it as it was."""
        view = self.view(run_id)
        run_id = view.id  # an id, also when given as the path of its folder
        if view.active:
            raise SpecError([f"run {run_id} is {view.live_state}: stop it (or stop and save) first"])
        if view.spec_problem:
            raise SpecError([f"run {run_id} cannot be resumed: its {folder.SPEC} {view.spec_problem}"])
        try:
            spec = load_spec(view.dir)  # resolved and checked when the run began
        except folder.DamagedRun as error:
            raise SpecError([f"run {run_id} cannot be resumed: {error}"]) from None
        found = list_checkpoints(view.dir)
        if not found:
            raise SpecError([f"run {run_id} saved no checkpoint, so it cannot be resumed: train with save_steps "
                             "(a checkpoint every N steps), or use Stop and save"])
        chosen = found[-1] if step is None else next((c for c in found if c["step"] == step), None)
        if chosen is None:
            raise SpecError([f"run {run_id} has no checkpoint at step {step}; it has steps "
                             f"{', '.join(str(c['step']) for c in found)}"])
        first = view.launch()
        backend = self._ready(spec, hardware.backend)
        if not backend.local_cores:  # the nodes are of the kind first planned for (Plan for, --instance)
            hardware = Hardware(**first["hardware"]) if first.get("hardware") else hardware
            launch = self._resume_plan(spec, hardware, None, run_id, chosen, first)
            self._restart(view.dir, launch, chosen)
            try:
                backend.submit(view.dir, launch, device=hardware.backend)
            except backends.SubmitError as error:
                events.append(view.dir / folder.EVENTS, events.status("stopped", reason=f"resume not submitted: "
                                                                                     f"{error}"))
                raise SpecError([f"not submitted: {error}"]) from error
            return self._started(run_id)
        with leases.choosing(self.runs_dir):
            spec = self._spec_to_resume(spec, hardware)
            cores = self.choose_cores(spec, hardware, wait=queue_if_busy)  # None: none free, it waits
            launch = self._resume_plan(spec, hardware, cores, run_id, chosen, first)
            if cores is None:
                # what a cancel gives back (a run whose processes ended silently: what the backend said)
                was = {"state": view.live_state,
                       "reason": view.reason if view.state in FINAL_STATES else view.error_text}
                queue.enter(view.dir, resume={"step": chosen["step"], "path": chosen["path"], "was": was})
                events.append(view.dir / folder.EVENTS, events.status("queued"))
            else:
                self._restart(view.dir, launch, chosen)
                backend.submit(view.dir, launch, device=hardware.backend)
        return self._started(run_id)

    def _spec_to_resume(self, spec: RunSpec, hardware: Hardware) -> RunSpec:
        """The spec a local resume plans with: its own cores, or the next free block ("next
        free") when any of them is taken now."""
        held, _ = leases.taken(self.runs_dir, hardware)
        if spec.layout.cores and set(parse_cores(spec.layout.cores)) & set(held):
            return replace(spec, layout=replace(spec.layout, cores=None))
        return spec

    def _resume_plan(self, spec: RunSpec, hardware: Hardware, cores, run_id: str, chosen: dict, first: dict) -> Plan:
        launch = self._plan(spec, hardware, cores, run_id)
        if launch.errors:
            raise SpecError(launch.errors)
        launch.env[RESUME_ENV] = chosen["path"]
        # the spec is the resolved one, so this plan applies nothing new: keep the first list
        return replace(launch, applied=[tuple(entry) for entry in first.get("applied", [])])

    @staticmethod
    def _restart(run_dir: Path, launch: Plan, chosen: dict) -> None:
        """The run folder made ready for its next attempt, from the checkpoint `chosen`."""
        clear_control(run_dir)
        folder.write_launch(run_dir, folder.launch_record(launch), created=folder.read_launch(run_dir).get("created"))
        events.append(run_dir / folder.EVENTS, events.resume(chosen["step"], chosen["path"]))
        events.append(run_dir / folder.EVENTS, events.status("starting"))

    def choose_cores(self, spec: RunSpec, hardware: Hardware, wait: bool = False,
                     warnings: list[str] | None = None) -> list[int] | None:
        """The cores the run will hold: the ones asked for if all are free, else the first free
        valid block ("next free"). On the CPU backend these are CPU cores the run is pinned to.
        Busy: SpecError naming who holds them, or with `wait` None (the run can wait for them).
        On Neuron, cores other programs use are busy too; `warnings` gets a line when they cannot be seen."""
        try:
            return leases.choose(self.runs_dir, hardware, spec.layout.nproc, spec.layout.cores, warnings)
        except leases.NoFreeCores as none:
            if none.wanted > none.count:  # no wait frees enough cores: the machine is too small
                raise SpecError([f"studio.nproc: {spec.layout.nproc} processes but this machine has {none.count} "
                                 f"{hardware.backend} cores: use at most {none.count}"]) from none
            if wait and none.held:
                return None
            raise SpecError([f"studio.nproc: no {spec.layout.nproc} free {hardware.backend} cores in a valid "
                             f"block; {none}: wait for or stop one of them, ask for fewer processes, or queue the "
                             "run (it starts when they are free)"]) from none
        except leases.NamedCoresHeld as error:
            if wait:
                return None
            raise SpecError([f"studio.cores: {error}"]) from error
        except ValueError as error:
            raise SpecError([f"studio.cores: {error}"]) from error

    def core_holders(self, hardware: Hardware) -> dict[int, str]:
        """The cores of this machine held now, each with who holds it ("run <id> (pid 123)"); on
        Neuron also those a program outside the studio uses (leases.taken)."""
        return {core: leases.describe(info) for core, info in leases.taken(self.runs_dir, hardware)[0].items()}

    def view_or_none(self, run_id: str) -> RunView | None:
        """The run, or None when it is not there (deleted, damaged)."""
        try:
            return self.view(run_id)
        except (RunNotFound, folder.DamagedRun):
            return None

    # --- reading -----------------------------------------------------------------------
    def view(self, run_id: str) -> RunView:
        """The run `run_id` of this runs folder. An id is a folder name here, never a path: a run
        elsewhere is reached with its own runs folder (--runs-dir), not with ../ or /."""
        run_id = folder.run_id_of(self.runs_dir, run_id)  # the path of a run folder in it names its run
        if not folder.is_run_id(run_id):
            raise RunNotFound(f"{run_id!r} is not a run id, nor the path of a run folder in the runs folder: give "
                              f"the id of a run in {self.runs_dir}, or point --runs-dir at the folder that holds "
                              "the run")
        run_dir = self.runs_dir / run_id
        if not folder.is_run(run_dir):
            raise RunNotFound(f"no run {run_id!r} in {self.runs_dir}")
        if not folder.inside(self.runs_dir, run_id):
            raise RunNotFound(f"{run_id!r} in {self.runs_dir} is a link to a folder outside it: give the id of a "
                              "run of that folder with its own runs folder (--runs-dir)")
        with self._lock:
            view = self._views.setdefault(run_id, RunView(dir=run_dir))
        return view.refresh()

    def list(self) -> list[RunView]:
        """Every run in the runs folder, newest first. A look at the runs starts a queue runner too
        when runs wait in the queue and none looks after them (queue.ensure_runner: the last one was
        killed, as by a reboot): `launch.py runs` and the Runs tab's refresh list them through here."""
        queue.ensure_runner(self.runs_dir)
        found = []
        for path in self.runs_dir.iterdir():
            if folder.is_run(path):
                try:
                    found.append(self.view(path.name))
                except KeyError:  # deleted while we looked
                    continue
        return sorted(found, key=lambda v: (v.created, v.id), reverse=True)

    def wait(self, run_id: str, until: Callable[[RunView], bool] | None = None, timeout: float = 600) -> RunView:
        """Follow the run until `until(view)` holds (default: it has ended) and return its view;
        TimeoutError after `timeout` seconds (a guard against a hang, not a schedule)."""
        until = until or (lambda view: view.live_state in FINAL_STATES)
        deadline = time.monotonic() + timeout
        while not until(view := self.view(run_id)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} did not get there within {timeout:g} s: it is {view.live_state} "
                                   f"at step {view.step}")
            time.sleep(WAIT_POLL_S)
        return view

    def active_runs(self) -> list[str]:
        """Ids of the runs that have not ended."""
        return [view.id for view in self.list() if view.live_state in ACTIVE_STATES]

    # --- stopping ----------------------------------------------------------------------
    def stop(self, run_id: str, grace_s: float = 20) -> RunView:
        """Stop a run now: its backend asks its processes to end, waits, ends what is left, and
        confirms none is. A queued run is cancelled (it ends as stopped, never started)."""
        view = self.view(run_id)
        if view.live_state == "queued" and self._cancel(view):
            return self.view(run_id)
        view.backend.stop(view.dir, grace_s)
        return self.view(run_id)

    def _cancel(self, view: RunView) -> bool:
        """Cancel a queued run; False when it started meanwhile (it is then stopped as a started one)."""
        try:
            queue.cancel(self.runs_dir, view.id)
        except queue.QueueError:
            return False
        return True

    def stop_and_save(self, run_id: str) -> RunView:
        """Ask the run to save a checkpoint at its next step and stop; it ends as "stopped",
        resumable from that checkpoint. Returns at once: the run stops by itself."""
        view = self.view(run_id)
        if not view.active:
            raise SpecError([f"run {view.id} is {view.live_state}: there is nothing to stop"])
        if view.live_state == "queued" and self._cancel(view):  # nothing to save: it never started
            return self.view(run_id)
        request_save_and_stop(view.dir)
        events.append(view.dir / folder.EVENTS, events.log("stop and save: asked for a checkpoint at the next "
                                                           "step, then a stop"))
        return view


DamagedRun = folder.DamagedRun  # a run folder's file that cannot be read: the front door's name for it
file_safe = folder.file_safe  # text made a file name's part (the app's exports and downloads)


def run_id_given(runs_dir: Path, given: str, read: bool = True) -> str:
    """The run id `given` names (an id, or the path of a run folder in `runs_dir`: folder.run_id_of);
    with `read`, that run's spec.yaml is read by the one rule: DamagedRun when it is damaged."""
    run_id = folder.run_id_of(runs_dir, given)
    if read and folder.is_run_id(run_id) and folder.is_run(runs_dir / run_id):
        folder.read_spec(runs_dir / run_id)
    return run_id
