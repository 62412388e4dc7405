"""The local backend: the run executes on this machine, under a supervisor process of its own.

    python -m studio_core.training.supervisor RUN_DIR      (started detached: its own session)

The supervisor holds the run's core leases, starts torchrun with the plan's command and
environment, samples the hardware, waits, and writes the final `status` event, also when a
rank was killed. Its pid and start time go to `supervisor.json` in the run folder, so a
restarted app finds it again (a reused pid is told apart by the start time).

A run is alive while its supervisor is, or, should the supervisor have been killed, while
its torchrun still holds the run's cores (it holds copies of the lease until it and its
ranks have ended; see studio_core.training.supervisor). How it ended comes from the final status
event, else from the supervisor's own record (`ended.json`), else it was lost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from studio_core.machine import children, leases
from studio_core.backends import forking
from studio_core.backends.base import Ending, RunBackend
from studio_core.machine.procs import kill_run_processes
from studio_core.machine.hardware import DEVICES
from studio_core.rundir import events
from studio_core.rundir.events import FINAL_STATES
from studio_core.rundir.folder import ENDED, EVENTS, LAUNCH, LOG, read_json, write_json

SUPERVISOR = "supervisor.json"
STARTING_GRACE_S = 30  # how long a folder may exist before its supervisor.json does
LOST = ("the run's supervisor ended without writing a final status (it was killed, or the machine restarted); "
        "no process of the run is left")
ORPHANED = "its supervisor is gone (killed?): the run's processes are ending, and hold cores {cores} until they have"


class LocalBackend(RunBackend):
    name = "local"
    label = "this machine"
    description = "this machine"

    def launch_argv(self, layout, module: str, run_dir: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                f"--nproc-per-node={layout.nproc}", "-m", module, str(run_dir)]

    def submit(self, run_dir: Path, launch, device: str) -> None:
        supervisor = forking.fork_supervisor(run_dir, launch.env, launch.argv, device)  # None: start one
        if supervisor is None:
            with open(run_dir / LOG, "ab") as log:
                supervisor = children.start("studio_core.training.supervisor", run_dir, env=launch.env,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=run_dir)
            # The supervisor is our child until we exit: reap it when it ends, or it stays a zombie.
            threading.Thread(target=supervisor.wait, name=f"reap-{run_dir.name}", daemon=True).start()
        write_json(run_dir / SUPERVISOR, {"pid": supervisor.pid,
                                          "create_time": psutil.Process(supervisor.pid).create_time()})
        leases.wait_held(run_dir.parent, device, launch.cores, supervisor)

    def alive(self, run_dir: Path) -> bool:
        return supervisor_process(run_dir) is not None or bool(_cores_still_held(run_dir))

    def where(self, run_dir: Path, live: bool) -> str | None:
        if not live or supervisor_process(run_dir) is not None:
            return None
        held = _cores_still_held(run_dir)
        return ORPHANED.format(cores=",".join(map(str, held))) if held else None

    def stop(self, run_dir: Path, grace_s: float) -> None:
        """SIGTERM the supervisor (it passes it on to torchrun and writes "stopped"), wait, then
        kill its whole process group; confirm no process carrying the run's marker is left."""
        supervisor = supervisor_process(run_dir)
        if supervisor is not None:
            supervisor.send_signal(signal.SIGTERM)
            _, alive = psutil.wait_procs([supervisor], timeout=grace_s)
            if alive:  # the supervisor is stuck: take the whole process group down ourselves
                os.killpg(supervisor.pid, signal.SIGKILL)
                psutil.wait_procs(alive, timeout=5)
                events.append(run_dir / EVENTS, events.status("stopped", exit_code=-signal.SIGKILL))
        left = kill_run_processes(run_dir.name)
        if left:
            raise RuntimeError(f"processes of run {run_dir.name} survived SIGKILL: {[p.pid for p in left]}")

    def ending(self, run_dir: Path, created: float) -> Ending | None:
        # a supervisor.json or ended.json from before this attempt began is the last attempt's:
        # a resumed run whose new supervisor is not up yet is starting, not how it ended before
        if not _written_since(run_dir / SUPERVISOR, created) and time.time() - created < STARTING_GRACE_S:
            return None
        record = read_json(run_dir / ENDED) if _written_since(run_dir / ENDED, created) else {}
        if record.get("state") in FINAL_STATES and record.get("reason"):  # e.g. a full disk took the event
            return Ending(record["state"], record["reason"])
        if record.get("state") in FINAL_STATES:  # the events file lost it, the supervisor's record did not
            return Ending(record["state"], f"{EVENTS} does not say how the run ended (deleted or damaged while it "
                          f"ran); its supervisor recorded it: {record['state']}, exit code {record.get('exit_code')}")
        return Ending("failed", LOST)


MTIME_SLACK_S = 0.05  # a file's time is the kernel's coarse clock (a tick of 4-10 ms behind time.time())


def _written_since(path: Path, moment: float) -> bool:
    try:
        return path.stat().st_mtime >= moment - MTIME_SLACK_S
    except FileNotFoundError:
        return False


def _cores_still_held(run_dir: Path) -> list[int]:
    """The run's cores that something of the run still holds (after its supervisor is gone: torchrun)."""
    launch = read_json(run_dir / LAUNCH)
    cores, device = launch.get("cores") or [], (launch.get("hardware") or {}).get("backend")  # neuron, cuda, cpu
    if not cores or device not in DEVICES:
        return []
    held = leases.holders(run_dir.parent, device, max(cores) + 1)
    return [core for core in cores if held.get(core, {}).get("holder") == run_dir.name]


def supervisor_process(run_dir: Path) -> psutil.Process | None:
    """The run's supervisor if it still runs (pid and start time both match)."""
    info = read_json(run_dir / SUPERVISOR)
    try:
        proc = psutil.Process(info["pid"])
        if abs(proc.create_time() - info["create_time"]) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except (KeyError, TypeError, psutil.NoSuchProcess):
        return None
    return None
