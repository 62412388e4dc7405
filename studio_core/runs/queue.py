"""The queue of local runs: a run whose cores are busy waits for them instead of being refused.

Its state is on disk like everything else, so an app restart or a reboot finds it again. A
queued run is a run folder whose events say `status queued` (its spec checked and planned, no
cores yet) with a `queue.json` that holds its place: `order`, a number, smallest first (the time
it was queued, until it is moved). When its turn comes and its cores are free, the run manager
(RunManager.start_queued) plans it on them and starts it as Start does, under the machine-wide
start lock (leases.choosing), re-reading its state there first: two apps on one runs folder never
start it twice, and a cancel or a delete never races a start. Strict order: a run waits while one
queued before it waits, so a big run is not starved by small ones that keep fitting.

A run that stopped or failed can be queued to resume (RunManager.resume with queue_if_busy): its
place then holds `resume`, the checkpoint it goes on from (chosen when it was queued) and the state
it was in, which a cancel gives back (the run is as it was, its end unchanged). Its attempt begins
when it starts, with the `resume` event, as a resume begins at once.

A sweep's runs (runs/sweep.py) may carry a `hold` in their place, which keeps a run waiting even
when its cores are free: `after`, a run whose precompile it shares (it waits until that run's
precompile has ended, or that run is no longer active), and `parallel` with `siblings`, the runs
of its sweep queued before it (it waits while `parallel` of them run). Strict order holds here too.

Who starts them: one queue runner per runs folder (`python -m studio_core.runs.queue_runner
RUNS_DIR`, detached, its output in `.queue.log`), which looks every QUEUE_POLL_S and exits when no
run is queued; it holds `.queue.lock` (flock) while it lives, so a second one exits at once. A
run queued starts it, and so do the app's start, `launch.py runs` and `launch.py queue`
(`ensure_runner`): after a reboot, the first of them to look.
"""

from __future__ import annotations

import fcntl
import math
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from studio_core.machine import children, leases
from studio_core.machine.hardware import Hardware
from studio_core.rundir import events, folder
from studio_core.runs import sweep_eval

QUEUE = "queue.json"  # in a queued run's folder: {"order": number, "hold": {...} (a sweep's run, see held_back),
#                        "resume": {"step", "path", "was": {"state", "reason"}} (a queued resume, see resume_of)}
LOCK, LOG = ".queue.lock", ".queue.log"  # in the runs folder
QUEUE_POLL_S = 1.0
CANCELLED = "cancelled while queued: it never started"


class QueueError(ValueError):
    """A queue action that cannot be done (the run is not queued, a place out of range): says why."""


def is_queued(run_dir: Path) -> bool:
    """Whether the run waits in the queue now (its folder has a place and its events say queued)."""
    return (run_dir / QUEUE).exists() and events.last_state(run_dir / folder.EVENTS) == "queued"


def queued(runs_dir: Path) -> list[Path]:
    """The queued runs' folders, first to start first. A run whose place cannot be read (a damaged
    queue.json) is left out: it never starts by itself, and `describe` says why; the others go on."""
    found = []
    for path in Path(runs_dir).iterdir():
        if (path / QUEUE).exists() and folder.is_run(path) and is_queued(path) and order_of(path) is not None:
            found.append((order_of(path), path.name, path))
    return [path for *_, path in sorted(found)]


def unreadable(runs_dir: Path) -> list[Path]:
    """The queued runs whose place cannot be read (left out of `queued`), by name."""
    return sorted(path for path in Path(runs_dir).iterdir() if (path / QUEUE).exists() and folder.is_run(path)
                  and is_queued(path) and order_of(path) is None)


def order_of(run_dir: Path) -> float | None:
    """A queued run's `order` (smallest first), None when its queue.json does not hold a number."""
    order = folder.read_json(run_dir / QUEUE).get("order")
    if isinstance(order, (int, float)) and not isinstance(order, bool) and math.isfinite(order):
        return float(order)
    return None


def place(run_dir: Path) -> tuple[int, int]:
    """(its place, 1 first; how many are queued)."""
    order = [path.name for path in queued(run_dir.parent)]
    return order.index(run_dir.name) + 1 if run_dir.name in order else 0, len(order)


def describe(run_dir: Path, view_of: Callable, order: list[str] | None = None) -> str:
    """What a queued run waits for: "queued, 1st of 2: waits for 1 free cpu core (2 of 2 are held
    (run ... (pid 12)))", or "queued, 2nd of 2: after run ...". `order`: the queued runs' names as
    queued() gives them, when the caller lists many (read once, not once a run)."""
    names = [path.name for path in queued(run_dir.parent)] if order is None else order
    if run_dir.name not in names:
        if (run_dir / QUEUE).exists() and order_of(run_dir) is None:
            return (f"queued, but its place cannot be read ({QUEUE} is damaged): it will not start; cancel it "
                    f"(`launch.py stop {run_dir.name}`) and start it again")
        return "queued"
    at = names.index(run_dir.name)
    resume = resume_of(run_dir)
    head = f"queued{' to resume from step ' + str(resume['step']) if resume else ''}, {ordinal(at + 1)} of {len(names)}"
    if at:
        return f"{head}: after run {names[at - 1]}"
    return f"{head}: {held_back(hold_of(run_dir), view_of) or waits_for(run_dir)}"


def hold_of(run_dir: Path) -> dict:
    """The run's hold in the queue ({} when none, or its place cannot be read)."""
    hold = folder.read_json(run_dir / QUEUE).get("hold")
    return hold if isinstance(hold, dict) else {}


def resume_of(run_dir: Path) -> dict | None:
    """A queued resume's checkpoint ({"step", "path", "was"}), None for a new run (or a place
    that cannot be read)."""
    resume = folder.read_json(run_dir / QUEUE).get("resume")
    return resume if isinstance(resume, dict) and isinstance(resume.get("step"), int) and resume.get("path") else None


def held_back(hold: dict, view_of: Callable) -> str | None:
    """Why a sweep's run waits although its cores may be free, in words; None when its hold lets
    it go. `after`: the run that precompiles the shapes this one shares (it waits until that run's
    precompile has ended, or that run is no longer active: then it compiles what it must itself).
    `parallel`: at most this many of `siblings` (its sweep's runs queued before it) at once.
    `view_of` gives a run's state by id (a RunView: live states; None when the run is gone)."""
    after = view_of(hold["after"]) if hold.get("after") else None
    if after and after.active and not (after.precompile and after.precompile.get("seconds") is not None):
        return f"waits for run {hold['after']} to precompile the shapes this run shares with it"
    parallel = hold.get("parallel")
    if parallel:
        running = [v for v in map(view_of, hold.get("siblings", [])) if v and v.active and v.live_state != "queued"]
        if len(running) >= parallel:
            return (f"waits for one of its sweep's {len(running)} running runs to end (at most {parallel} at once: "
                    "--parallel)")
    return None


def waits_for(run_dir: Path) -> str:
    """The cores the first queued run waits for and who holds them now."""
    from studio_core.recipe.spec import load_spec

    try:
        spec, hardware = load_spec(run_dir), Hardware(**folder.read_launch(run_dir)["hardware"])
        # a resume takes any free block (RunManager.resume): it waits for none in particular
        leases.choose(run_dir.parent, hardware, spec.layout.nproc, None if resume_of(run_dir) else spec.layout.cores)
    except leases.NoFreeCores as none:
        return f"waits for {none.wanted} free {hardware.backend} core(s) ({none})"
    except leases.NamedCoresHeld as busy:
        return "waits for its cores: " + str(busy).split(": choose free cores")[0]
    except (folder.DamagedRun, KeyError, TypeError, ValueError) as error:
        return f"cannot be read ({error})"
    return "its cores are free: it starts in a moment"


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def enter(run_dir: Path, hold: dict | None = None, resume: dict | None = None) -> None:
    """Give a new run folder (not yet renamed to its id) its place: last, with its `hold` if any;
    or a stopped run's, to `resume` ({"step", "path", "was": its state and reason now})."""
    folder.write_json(run_dir / QUEUE, {"order": time.time(), **({"hold": hold} if hold else {}),
                                        **({"resume": resume} if resume else {})})


def leave(run_dir: Path) -> None:
    """The run leaves the queue (it starts, or is cancelled)."""
    (run_dir / QUEUE).unlink(missing_ok=True)


def cancel(runs_dir: Path, run_id: str) -> None:
    """End a queued run before it starts: it ends as stopped, saying it never started. A queued
    resume is called off: the run is back in the state it had (stopped or failed, its reason)."""
    with leases.choosing(runs_dir):  # no queue runner starts it meanwhile
        run_dir = Path(runs_dir) / run_id
        if not is_queued(run_dir):
            raise QueueError(f"run {run_id} is not queued (it has started or ended)")
        resume = resume_of(run_dir)
        if resume:
            was = resume.get("was") if isinstance(resume.get("was"), dict) else {}
            events.append(run_dir / folder.EVENTS, events.log(f"the resume from step {resume['step']} was cancelled "
                                                              "while queued"))
            events.append(run_dir / folder.EVENTS, events.status(was.get("state", "stopped"), reason=was.get("reason")))
        else:
            events.append(run_dir / folder.EVENTS, events.status("stopped", reason=CANCELLED))
        leave(run_dir)


def move(runs_dir: Path, run_id: str, to: int) -> int:
    """Move a queued run to place `to` (1: next to start); the place it has now."""
    with leases.choosing(runs_dir):
        order = queued(runs_dir)
        names = [path.name for path in order]
        if run_id not in names:
            raise QueueError(f"{not_queued(Path(runs_dir), run_id)}: `launch.py queue` lists the queued runs")
        if not 1 <= to <= len(names):
            raise QueueError(f"place {to} is out of the queue's 1 to {len(names)}")
        rest = [path for path in order if path.name != run_id]
        rest.insert(to - 1, order[names.index(run_id)])
        base = min(order_of(path) for path in order)
        for n, path in enumerate(rest):  # renumbered in their new order, each keeping its hold
            folder.write_json(path / QUEUE, {**folder.read_json(path / QUEUE), "order": base + n})
    return to


def not_queued(runs_dir: Path, run_id: str) -> str:
    """Why the run `run_id` has no place in the queue's order, in words."""
    run_dir = runs_dir / run_id
    if not (folder.is_run_id(run_id) and folder.is_run(run_dir)):
        return f"there is no run {run_id!r} in {runs_dir}"
    if is_queued(run_dir):  # queued, its place unreadable (a damaged queue.json)
        return (f"run {run_id} is queued, but its place cannot be read ({QUEUE} is damaged): cancel it "
                f"(`launch.py stop {run_id}`) and start it again")
    return f"run {run_id} is not queued (it has started or ended)"


def lock_queue(runs_dir: Path) -> int | None:
    """The runs folder's queue lock, taken: an open descriptor holding it, or None when a runner
    holds it already."""
    fd = os.open(Path(runs_dir) / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def ensure_runner(runs_dir: Path) -> bool:
    """Start the queue runner when runs are queued or a sweep's run waits to be evaluated, and none
    runs; whether one was started. Whatever starts or lists runs calls it (RunManager's start,
    resume and list: the Runs tab's refresh, `launch.py runs`; `launch.py queue`), so a runner that
    was killed (SIGKILL, a reboot) is replaced at the next look. The lock is taken here and handed
    to the runner (an inherited descriptor), so a second call in the same moment sees it held,
    however long the runner takes to start; a killed runner's lock the system has let go."""
    runs_dir = Path(runs_dir)
    try:
        if not queued(runs_dir) and not sweep_eval.waiting(runs_dir):
            return False
        fd = lock_queue(runs_dir)
        if fd is None:
            return False
        try:
            with open(runs_dir / LOG, "ab") as log:
                runner = children.start("studio_core.runs.queue_runner", runs_dir, fd, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(fd,))
        finally:
            os.close(fd)  # the runner's copy holds the lock now
    except OSError:  # a runs folder this user cannot write to: its owner's runner starts its runs
        return False
    # it outlives this process on purpose (it starts the queued runs after the app or CLI has gone);
    # reaped by a thread while we live, so that it leaves no zombie behind
    threading.Thread(target=runner.wait, name="reap-queue-runner", daemon=True).start()
    return True
