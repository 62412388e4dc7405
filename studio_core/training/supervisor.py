"""The per-run supervisor: starts torchrun, waits for it, writes the run's final status. An
entry point, never imported. (A run of one process on this machine starts its worker directly,
with the variables torchrun would give its one rank: one_rank; "torchrun" below is then that
worker, which keeps every promise said of torchrun here.)

    python -m studio_core.training.supervisor RUN_DIR
Local backend: started detached (its own session) by studio_core.backends.local, with output
to train.log. It outlives the web app, so closing or restarting the app changes nothing for a run.
On a cluster, the place starts one on every node of the run, and the run's backend gives it its
node (RunBackend.node; backends.base.Node): it holds no lease (the job has its nodes to itself),
sets the rendezvous for its node's torchrun, tags its hardware samples with the node, and only
the first node's writes the final status, and only when the run finished or stopped as asked.
When the place ends the run (a cancel, a time limit) or the run fails (a node may have died), it
writes none: the backend records the ending, with the place's reason, once the run is gone.

It holds the run's core leases (studio_core.machine.leases) from before torchrun starts until
every process of the run has ended; on the CPU backend it pins itself, and so torchrun
and every rank, to those CPU cores. Nothing of the run outlives it: torchrun is started
with the kernel's parent-death signal (PR_SET_PDEATHSIG) set to SIGTERM, on which torchrun
ends its ranks and waits for them, and every rank has SIGKILL as its own (the worker sets
it), should torchrun itself be killed. torchrun also holds copies of the lease's locks
(an flock is released when the last descriptor of it closes), so if the supervisor is
SIGKILLed the cores stay held until torchrun, after its ranks, has ended too.
The final `status` event is written here, not by the workers, so it is there even when
a rank is killed or dies in native code. SIGTERM (the manager's stop) is passed on to
torchrun; whatever of the run is still alive after a grace period is killed. A stop the user
asked for is recorded as such: "stopped", exit code 0 (torchrun's own code, which its SIGTERM
makes 1, goes to a log line), unless the run had to be killed after the grace period.

A full disk must not cost the run its final status: the supervisor holds a small reserve file
(RESERVE) in the run folder from its start, writes events without dying when the disk is full,
and when torchrun has ended deletes the reserve, so the final status, `ended.json` (written
first: it is tiny) and an error saying which disk is full fit. After every attempt it removes
checkpoint folders a failed save left partial (checkpoints.remove_incomplete).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from studio_core import backends
from studio_core.machine import children, leases
from studio_core.rundir.checkpoints import (
    DISK_FULL_ERRNOS,
    DISK_FULL_WORDS,
    RESUME_ENV,
    disk_full_text,
    remove_incomplete,
)
from studio_core.machine.device_env import given_cores
from studio_core.machine.hardware import Hardware, pin_to_cpu_cores, studio_cpus
from studio_core.backends import forking
from studio_core.training.precompile import WORKER_MODULE as PRECOMPILE_MODULE
from studio_core.training.precompile import job_environment
from studio_core.backends.forking import ONE_RANK_ENV, one_rank
from studio_core.recipe.spec import RunSpec
from studio_core.machine.monitor import SAMPLE_EVERY_S, RunMonitor
from studio_core.machine.procs import die_with_parent, kill_run_processes
from studio_core.rundir import events as ev
from studio_core.rundir.events import EventReader
from studio_core.rundir.folder import ENDED, EVENTS, LOG, SPEC, read_launch, write_json

GRACE_S = 10
LOG_TAIL_LINES = 60
LOG_TAIL_BYTES = 64 << 10
RESERVE = ".disk-reserve"  # room kept for the final status, released when torchrun has ended
RESERVE_BYTES = 256 << 10
disk_full_seen = False  # a write of this supervisor failed for want of space


def write(path: Path, event: dict) -> None:
    """Append an event; on a full disk note it (disk_full_seen) and go on: the supervisor must live
    to write the final status."""
    global disk_full_seen
    try:
        ev.append(path, event)
    except OSError as error:
        if error.errno not in DISK_FULL_ERRNOS:
            raise
        disk_full_seen = True


def hold_reserve(run_dir: Path) -> None:
    """The reserve file: RESERVE_BYTES really written (not sparse), so that deleting it frees them."""
    try:
        (run_dir / RESERVE).write_bytes(bytes(RESERVE_BYTES))
    except OSError as error:
        if error.errno not in DISK_FULL_ERRNOS:
            raise
        (run_dir / RESERVE).unlink(missing_ok=True)  # no room even for it: the run will say so soon


def release_reserve(run_dir: Path) -> bool:
    """Delete the reserve; whether the disk was full then (less free than the reserve, or a write failed)."""
    try:
        full = disk_full_seen or shutil.disk_usage(run_dir).free < RESERVE_BYTES
    except OSError:
        full = disk_full_seen
    (run_dir / RESERVE).unlink(missing_ok=True)
    return full


def main(run_dir: Path) -> int:
    launch = read_launch(run_dir)
    events = run_dir / EVENTS
    this_attempt = EventReader(events)
    this_attempt.read_new()  # a resumed run's folder holds earlier attempts' events: skip them
    stop_requested_at: float | None = None
    torchrun: subprocess.Popen | None = None

    def on_stop(signum, frame):  # from the first moment: a stop asked while starting is a stop too
        nonlocal stop_requested_at
        stop_requested_at = stop_requested_at or time.monotonic()
        if torchrun is not None:
            torchrun.send_signal(signal.SIGTERM)  # torchrun passes it on to every rank

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    hold_reserve(run_dir)
    device, cores = launch["hardware"]["backend"], launch["cores"]  # neuron, cuda or cpu
    node = backends.get(launch.get("backend")).node(run_dir, launch)  # None: a run of this machine alone
    argv = launch["argv"]
    if node is not None:
        node.started()
        argv = node.prepare(argv)
        nproc = next(int(a.split("=", 1)[1]) for a in argv if a.startswith("--nproc-per-node="))
        cores, lease = given_cores(device, nproc), None  # what Ray assigned the node's actor, else its first
        if node.first:
            write(events, ev.log(node.describe()))
        restart_from = node.restart_from(launch["env"])
        if restart_from is not None:  # every node goes on from it; the first says so in the events
            launch["env"][RESUME_ENV] = restart_from["path"]
            if node.first:
                write(events, ev.resume(restart_from["step"], restart_from["path"]))
    else:
        try:  # held until this process ends, after every process of the run has
            lease = leases.acquire(run_dir.parent, device, cores, holder=run_dir.name, kind="run")
        except leases.CoresBusy as busy:  # taken between the manager's check and now
            write(events, ev.error(str(busy)))
            release_reserve(run_dir)
            ended(run_dir, "failed", None)
            return 1
        write(events, ev.log(f"holding {device} cores {cores}"))
        cpus = studio_cpus()  # before the pinning below narrows what this process may use
        if device == "cpu":
            pin_to_cpu_cores(cores)  # torchrun and every rank inherit the pinning
        jobs = precompile_jobs(run_dir, launch)
        if jobs:
            precompile(run_dir, launch, jobs, cpus, lambda: stop_requested_at is not None)
            if stop_requested_at is not None:
                release_reserve(run_dir)
                ended(run_dir, "stopped", None)
                return 0

    env, direct = launch["env"], one_rank(argv) if node is None else None
    if direct is not None:  # one process on this machine: torchrun's start (a second or more) saved
        argv, env = direct, {**env, **ONE_RANK_ENV, "MASTER_PORT": str(_free_ports(1)[0])}
    torchrun = None
    if direct is not None and device == "cpu" and forking.forked:  # a fork of the zygote: the worker is one too
        torchrun = forking.fork_worker(run_dir, children.environment(env))
    if torchrun is None:
        torchrun = subprocess.Popen(argv, stdin=subprocess.DEVNULL, cwd=run_dir, env=children.environment(env),
                                    pass_fds=lease.descriptors() if lease else (),
                                    preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    where = f" on node {node.name}" if node else ""
    started = ("the worker started (one process: the environment torchrun gives its one rank, without "
               "torchrun)" if direct else "torchrun started")
    if isinstance(torchrun, forking.Forked):
        started += "; forked from the studio's zygote, its libraries already imported"
    write(events, ev.log(f"{started}{where} (pid {torchrun.pid})"))
    monitor: RunMonitor | None = RunMonitor(device, cores, torchrun.pid)  # hardware events, every ~2 s
    if node is None or node.first:
        write(events, ev.log(monitor.describe()))
    next_sample = time.monotonic() + SAMPLE_EVERY_S

    if stop_requested_at is not None:  # asked before torchrun was there to pass it to
        torchrun.send_signal(signal.SIGTERM)
    while True:
        try:
            code = torchrun.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            if stop_requested_at and time.monotonic() - stop_requested_at > GRACE_S:
                torchrun.kill()
        if monitor is not None and time.monotonic() >= next_sample:
            next_sample += SAMPLE_EVERY_S
            try:
                sample = monitor.sample()
                if sample["processes"]:  # none: torchrun ended just after the wait above; its status follows
                    write(events, ev.hardware({**sample, **({"node": node.name} if node else {})}))
            except Exception as failed:  # sampling must never cost the run its final status
                write(events, ev.log(f"hardware sampling stopped: {failed!r}"))
                monitor.stop()
                monitor = None
    if monitor is not None:
        monitor.stop()  # before the leftover check below: neuron-monitor carries the run's marker too
    stop_requested = stop_requested_at is not None
    if node is not None:
        node.ended(code, stop_requested)
    left = kill_run_processes(os.environ["STUDIO_RUN_ID"], node.task_marker if node else ())  # ranks torchrun left
    if left:
        write(events, ev.log(f"processes that survived SIGKILL: {[p.pid for p in left]}"))

    disk_was_full = release_reserve(run_dir)
    if lease is not None:
        lease.release()
    if node is not None and not node.first:
        return 0  # the first node says how the run ended
    removed = remove_incomplete(run_dir)  # nothing of the run writes any more
    if removed:
        write(events, ev.log(f"removed {', '.join(removed)}: a save that did not complete (resume never picks it)"))
    if node is not None and stop_requested:
        write(events, ev.log(node.left_to_place(code, stopped=True)))
        return 0  # the backend writes the final status, with the place's reason, once the run is gone
    attempt = this_attempt.read_new()
    saved_stop = any(e["type"] == "saved_stop" for e in attempt)
    if stop_requested and code not in (0, -signal.SIGKILL):  # SIGTERM makes torchrun exit 1: an ordered stop
        write(events, ev.log(f"torchrun ended on the stop (SIGTERM to it and its ranks) with its code {code}"))
    if stop_requested or (code == 0 and saved_stop):  # stopped, by signal or with a checkpoint as asked
        ended(run_dir, "stopped", code if code == -signal.SIGKILL else 0)  # killed after the grace: says so
    elif code == 0:
        ended(run_dir, "finished", 0)
    else:
        tail = _log_tail(run_dir / LOG)
        cause = root_cause(tail)
        worker_error = any(e["type"] == "error" for e in attempt)
        said_full = any(e["type"] == "error" and "the disk is full" in e.get("message", "") for e in attempt)
        if not said_full and (disk_was_full or any(word in tail.lower() for word in DISK_FULL_WORDS)):
            # the ranks could not say it (their writes failed too): the last error is the one shown
            reason = disk_full_text(run_dir) + (f" (the partial {', '.join(removed)} was removed)" if removed else "")
            write(events, ev.error(reason, traceback=tail[-4000:]))
            ended(run_dir, "failed", code, reason)
            return 0
        if direct is not None and code < 0 and not cause:  # no torchrun to name the killed rank
            cause = one_rank_killed(code)
        if cause and "killed" in cause:
            # A killed rank leaves only the others' knock-on errors ("connection reset"):
            # say what really happened, as the last error, which is the one shown.
            write(events, ev.error(cause, traceback=tail))
        elif not worker_error:
            write(events, ev.error(cause or f"torchrun exited with code {code}", traceback=tail))
        if node is not None:  # a failed node may be the cause: the place says so once the run has ended
            write(events, ev.log(node.left_to_place(code, stopped=False)))
            return 0
        ended(run_dir, "failed", code)
    return 0


def precompile_jobs(run_dir: Path, launch: dict) -> int:
    """How many precompile jobs this start runs: the spec's, on a first start only (a resumed run
    finds its shapes in the cache already)."""
    spec = RunSpec.load(run_dir / SPEC)
    return (spec.precompile_jobs or 1) if spec.precompile and RESUME_ENV not in launch["env"] else 0


def precompile(run_dir: Path, launch: dict, wanted: int, cpus: list[int], stopping) -> None:
    """Run the precompile jobs (studio_core/training/precompile.py) to their end, each on a core of its own:
    the run's cores, then free ones of this machine, leased meanwhile. `stopping()`: a stop was
    asked; the jobs are then ended. A failed job is logged; the run goes on without its shapes."""
    device, events = launch["hardware"]["backend"], run_dir / EVENTS
    own = list(launch["cores"])
    extra = []
    hardware = Hardware(**launch["hardware"])
    busy, _ = leases.taken(run_dir.parent, hardware)  # on Neuron also cores other programs use
    for core in sorted(set(range(hardware.cores)) - set(busy)):
        if len(own) + len(extra) >= wanted:
            break
        try:
            extra.append(leases.acquire(run_dir.parent, device, [core], holder=run_dir.name, kind="precompile"))
        except leases.CoresBusy:
            continue  # taken meanwhile
    cores = own + [lease.cores[0] for lease in extra]
    jobs = min(wanted, len(cores))
    write(events, ev.log(f"precompile: {jobs} job(s) on {device} cores {cores[:jobs]}"
                             + (f" ({wanted} asked; the other cores are busy)" if jobs < wanted else "")))
    began = time.monotonic()
    procs, ports = [], _free_ports(jobs)
    for job in range(jobs):
        cpu = cpus[cores[job]] if device == "cpu" else None
        procs.append(children.start(
            PRECOMPILE_MODULE, run_dir, job, jobs, stdin=subprocess.DEVNULL, cwd=run_dir,
            env=job_environment(device, launch["env"], cores[job], ports[job]),
            preexec_fn=lambda cpu=cpu: _job_start(cpu)))
    try:
        while any(p.poll() is None for p in procs):
            if stopping():
                for p in procs:
                    p.terminate()
                break
            time.sleep(0.5)
        for p in procs:
            try:
                p.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    finally:
        for lease in extra:
            lease.release()
    failed = [job for job, p in enumerate(procs) if p.returncode != 0]
    if failed and not stopping():
        write(events, ev.log(f"precompile job(s) {failed} failed (train.log has their output): the run "
                                 "compiles their shapes at their first step"))
    write(events, ev.precompile_end(round(time.monotonic() - began, 3), failed))


def _free_ports(count: int) -> list[int]:
    """`count` different free ports, one per precompile job's rendezvous: the probes stay open until
    all are chosen (one probe closed before the next is opened can be given the same port again,
    and the second job then fails with EADDRINUSE, as a CI run's smoke test met)."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


def _job_start(cpu: int | None) -> None:
    """In a precompile job, before it runs: it dies with the supervisor, on its own CPU."""
    die_with_parent(signal.SIGTERM)
    if cpu is not None:
        os.sched_setaffinity(0, [cpu])


def ended(run_dir: Path, state: str, code: int | None, reason: str | None = None) -> None:
    """The final status: the supervisor's own record (ENDED), which still says how the run ended if
    its events file was deleted or damaged meanwhile (or the disk had room for this tiny file
    only: it goes first), and the event. `reason`: why, for ENDED, when the events may lack it."""
    try:
        write_json(run_dir / ENDED, {"state": state, "exit_code": code, "time": time.time(),
                                     **({"reason": reason} if reason else {})})
    except OSError as error:
        if error.errno not in DISK_FULL_ERRNOS:
            raise
        (run_dir / f".{ENDED}.tmp").unlink(missing_ok=True)  # the event below may still fit
    write(run_dir / EVENTS, ev.status(state, exit_code=code, reason=reason))


ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?"
                        r"exitcode\s*:\s*(-?\d+)", re.S)


def one_rank_killed(code: int) -> str:
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    return f"rank 0 was killed by {name}"


def root_cause(log_text: str) -> str | None:
    """torchrun's "Root Cause" block, in a sentence: which rank ended first, and how."""
    match = ROOT_CAUSE.search(log_text)
    if not match:
        return None
    rank, code = match.group(1), int(match.group(2))
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        return f"rank {rank} was killed by {name}; torchrun then ended the other ranks"
    return f"rank {rank} failed first, with exit code {code}"


def _log_tail(path: Path) -> str:
    try:
        with path.open("rb") as handle:  # the end only: progress bars make lines of megabytes (\r, no \n)
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - LOG_TAIL_BYTES))
            lines = handle.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in lines[-LOG_TAIL_LINES:])


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
