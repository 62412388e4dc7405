"""The per-run supervisor: starts torchrun, waits for it, writes the run's final status. An
entry point, never imported.

    python -m studio_core.supervisor RUN_DIR
Local backend: started detached (its own session) by studio_core.backends.local, with output
to train.log. It outlives the web app, so closing or restarting the app changes nothing for a run.
Slurm backend: the batch script's `srun` starts one on every node of the job (see `on_slurm`):
it holds no lease (the job has its nodes to itself), sets the rendezvous address for its
node's torchrun, tags its hardware samples with the node, and only the first node's writes
the final status, and only when the run finished or stopped as asked. When Slurm ends the job
(scancel, time limit) or the run fails (a node may have died), it writes none: the Slurm
backend records the ending, with Slurm's reason, once the job is gone.

It holds the run's core leases (studio_core.leases) from before torchrun starts until
every process of the run has ended; on the CPU backend it pins itself, and so torchrun
and every rank, to those CPU cores. Nothing of the run outlives it: torchrun is started
with the kernel's parent-death signal (PR_SET_PDEATHSIG) set to SIGTERM, on which torchrun
ends its ranks and waits for them, and every rank has SIGKILL as its own (the worker sets
it), should torchrun itself be killed. torchrun also holds copies of the lease's locks
(an flock is released when the last descriptor of it closes), so if the supervisor is
SIGKILLed the cores stay held until torchrun, after its ranks, has ended too.
The final `status` event is written here, not by the workers, so it is there even when
a rank is killed or dies in native code. SIGTERM (the manager's stop) is passed on to
torchrun; whatever of the run is still alive after a grace period is killed.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from studio_core import children, leases, slurm
from studio_core.backends.slurm import AUTO_RESUME_ENV, JOB
from studio_core.checkpoints import RESUME_ENV, list_checkpoints
from studio_core.hardware import Hardware, pin_to_cpu_cores, studio_cpus
from studio_core.precompile import WORKER_MODULE as PRECOMPILE_MODULE
from studio_core.precompile import job_environment
from studio_core.spec import RunSpec
from studio_core.monitor import SAMPLE_EVERY_S, RunMonitor
from studio_core.procs import die_with_parent, kill_run_processes
from studio_core.runs import events as ev
from studio_core.runs.events import EventReader
from studio_core.runs.folder import ENDED, EVENTS, LOG, SPEC, read_json, read_launch, write_json

GRACE_S = 10
SLURM_TASK = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID")  # what this node's task's processes share
RDZV_BASE_PORT = 29500  # a Slurm job's rendezvous port: this plus its job id modulo 1000
LOG_TAIL_LINES = 60


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
    backend, cores = launch["hardware"]["backend"], launch["cores"]
    node = on_slurm(launch)
    argv = launch["argv"]
    if node is not None:
        os.environ.update(slurm_rendezvous(node))
        argv = [os.path.expandvars(arg) for arg in argv]  # $HEAD_ADDR, $RDZV_PORT, $SLURM_JOB_ID
        nproc = next(int(a.split("=", 1)[1]) for a in argv if a.startswith("--nproc-per-node="))
        cores, lease = list(range(nproc)), None  # the node is the job's: its first nproc cores
        if node.first:
            ev.append(events, ev.log(f"Slurm job {node.job_id} runs on {node.names}; rendezvous at "
                                     f"{os.environ['HEAD_ADDR']}:{os.environ['RDZV_PORT']}"))
        restart_from = auto_resumed(run_dir, launch["env"])
        if restart_from is not None:  # every node goes on from it; the first says so in the events
            launch["env"][RESUME_ENV] = restart_from["path"]
            if node.first:
                ev.append(events, ev.resume(restart_from["step"], restart_from["path"]))
    else:
        try:  # held until this process ends, after every process of the run has
            lease = leases.acquire(run_dir.parent, backend, cores, holder=run_dir.name, kind="run")
        except leases.CoresBusy as busy:  # taken between the manager's check and now
            ev.append(events, ev.error(str(busy)))
            ended(run_dir, "failed", None)
            return 1
        ev.append(events, ev.log(f"holding {backend} cores {cores}"))
        cpus = studio_cpus()  # before the pinning below narrows what this process may use
        if backend == "cpu":
            pin_to_cpu_cores(cores)  # torchrun and every rank inherit the pinning
        jobs = precompile_jobs(run_dir, launch)
        if jobs:
            precompile(run_dir, launch, jobs, cpus, lambda: stop_requested_at is not None)
            if stop_requested_at is not None:
                ended(run_dir, "stopped", None)
                return 0

    torchrun = subprocess.Popen(argv, stdin=subprocess.DEVNULL, cwd=run_dir, env=children.environment(launch["env"]),
                                pass_fds=lease.descriptors() if lease else (),
                                preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    where = f" on node {node.name}" if node else ""
    ev.append(events, ev.log(f"torchrun started{where} (pid {torchrun.pid})"))
    monitor: RunMonitor | None = RunMonitor(backend, cores, torchrun.pid)  # hardware events, every ~2 s
    if node is None or node.first:
        ev.append(events, ev.log(monitor.describe()))
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
                    ev.append(events, ev.hardware({**sample, **({"node": node.name} if node else {})}))
            except Exception as failed:  # sampling must never cost the run its final status
                ev.append(events, ev.log(f"hardware sampling stopped: {failed!r}"))
                monitor.stop()
                monitor = None
    if monitor is not None:
        monitor.stop()  # before the leftover check below: neuron-monitor carries the run's marker too
    stop_requested = stop_requested_at is not None
    left = kill_run_processes(os.environ["STUDIO_RUN_ID"], SLURM_TASK if node else ())  # ranks torchrun left
    if left:
        ev.append(events, ev.log(f"processes that survived SIGKILL: {[p.pid for p in left]}"))

    if lease is not None:
        lease.release()
    if node is not None and not node.first:
        return 0  # the first node says how the run ended
    if node is not None and stop_requested:
        ev.append(events, ev.log(f"Slurm asked job {node.job_id} to end (SIGTERM): torchrun exited with {code}"))
        return 0  # the Slurm backend writes the final status, with Slurm's reason, once the job is gone
    attempt = this_attempt.read_new()
    saved_stop = any(e["type"] == "saved_stop" for e in attempt)
    if stop_requested or (code == 0 and saved_stop):  # stopped, by signal or with a checkpoint as asked
        ended(run_dir, "stopped", code)
    elif code == 0:
        ended(run_dir, "finished", 0)
    else:
        tail = _log_tail(run_dir / LOG)
        cause = root_cause(tail)
        worker_error = any(e["type"] == "error" for e in attempt)
        if cause and "killed" in cause:
            # A killed rank leaves only the others' knock-on errors ("connection reset"):
            # say what really happened, as the last error, which is the one shown.
            ev.append(events, ev.error(cause, traceback=tail))
        elif not worker_error:
            ev.append(events, ev.error(cause or f"torchrun exited with code {code}", traceback=tail))
        if node is not None:  # a failed node may be the cause: Slurm says so once the job has ended
            ev.append(events, ev.log(f"torchrun exited with code {code}; the final status comes when Slurm has "
                                     f"ended job {node.job_id}"))
            return 0
        ended(run_dir, "failed", code)
    return 0


def precompile_jobs(run_dir: Path, launch: dict) -> int:
    """How many precompile jobs this start runs: the spec's, on a first start only (a resumed run
    finds its shapes in the cache already)."""
    spec = RunSpec.load(run_dir / SPEC)
    return (spec.precompile_jobs or 1) if spec.precompile and RESUME_ENV not in launch["env"] else 0


def precompile(run_dir: Path, launch: dict, wanted: int, cpus: list[int], stopping) -> None:
    """Run the precompile jobs (studio_core/precompile.py) to their end, each on a core of its own:
    the run's cores, then free ones of this machine, leased meanwhile. `stopping()`: a stop was
    asked; the jobs are then ended. A failed job is logged; the run goes on without its shapes."""
    backend, events = launch["hardware"]["backend"], run_dir / EVENTS
    own = list(launch["cores"])
    extra = []
    for core in sorted(leases.free_cores(run_dir.parent, backend, Hardware(**launch["hardware"]).cores)):
        if len(own) + len(extra) >= wanted:
            break
        try:
            extra.append(leases.acquire(run_dir.parent, backend, [core], holder=run_dir.name, kind="precompile"))
        except leases.CoresBusy:
            continue  # taken meanwhile
    cores = own + [lease.cores[0] for lease in extra]
    jobs = min(wanted, len(cores))
    ev.append(events, ev.log(f"precompile: {jobs} job(s) on {backend} cores {cores[:jobs]}"
                             + (f" ({wanted} asked; the other cores are busy)" if jobs < wanted else "")))
    began = time.monotonic()
    procs = []
    for job in range(jobs):
        cpu = cpus[cores[job]] if backend == "cpu" else None
        procs.append(children.start(
            PRECOMPILE_MODULE, run_dir, job, jobs, stdin=subprocess.DEVNULL, cwd=run_dir,
            env=job_environment(backend, launch["env"], cores[job], _free_port()),
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
        ev.append(events, ev.log(f"precompile job(s) {failed} failed (train.log has their output): the run "
                                 "compiles their shapes at their first step"))
    ev.append(events, ev.precompile_end(round(time.monotonic() - began, 3), failed))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _job_start(cpu: int | None) -> None:
    """In a precompile job, before it runs: it dies with the supervisor, on its own CPU."""
    die_with_parent(signal.SIGTERM)
    if cpu is not None:
        os.sched_setaffinity(0, [cpu])


def ended(run_dir: Path, state: str, code: int | None) -> None:
    """The final status: an event, and the supervisor's own record (ENDED), which still says how
    the run ended if its events file was deleted or damaged meanwhile."""
    ev.append(run_dir / EVENTS, ev.status(state, **({} if code is None else {"exit_code": code})))
    write_json(run_dir / ENDED, {"state": state, "exit_code": code, "time": time.time()})


@dataclass(frozen=True)
class SlurmNode:
    name: str  # this node's Slurm name
    names: str  # the job's nodes, as Slurm writes them (n[1-2])
    job_id: str
    first: bool  # the first node: the rendezvous host, and the one that writes the final status


def on_slurm(launch: dict) -> SlurmNode | None:
    """This node, when the supervisor runs as a task of a Slurm job of the Slurm backend."""
    if launch.get("backend") != "slurm" or "SLURM_JOB_ID" not in os.environ:
        return None
    return SlurmNode(os.environ.get("SLURMD_NODENAME", "?"), os.environ.get("SLURM_JOB_NODELIST", "?"),
                     os.environ["SLURM_JOB_ID"], os.environ.get("SLURM_NODEID", "0") == "0")


def auto_resumed(run_dir: Path, env: dict) -> dict | None:
    """With HyperPod's auto-resume, the job's step starts again after a node failure: the newest
    checkpoint this job saved (one newer than its submission), to go on from; None on a first start."""
    if env.get(AUTO_RESUME_ENV) != "1":
        return None
    submitted = read_json(run_dir / JOB).get("submitted", time.time())
    saved = [c for c in list_checkpoints(run_dir) if Path(c["path"]).stat().st_mtime > submitted]
    return saved[-1] if saved else None


def slurm_rendezvous(node: SlurmNode) -> dict[str, str]:
    """HEAD_ADDR (the first node's address, as Slurm knows it: NodeAddr) and RDZV_PORT for torchrun."""
    return {"HEAD_ADDR": slurm.first_node_address(node.names),
            "RDZV_PORT": str(RDZV_BASE_PORT + int(node.job_id) % 1000)}


ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?"
                        r"exitcode\s*:\s*(-?\d+)", re.S)


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
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
