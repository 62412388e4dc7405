"""The per-run supervisor of the local backend: starts torchrun, waits for it, writes the
run's final status. An entry point, never imported.

Started detached (its own session) by studio_core.backends.local, with output to train.log:
    python -m studio_core.supervisor RUN_DIR
It outlives the web app, so closing or restarting the app changes nothing for a run.
It holds the run's core leases (studio_core.leases) from before torchrun starts until
every process of the run has ended; on the CPU backend it pins itself, and so torchrun
and every rank, to those CPU cores.
The final `status` event is written here, not by the workers, so it is there even when
a rank is killed or dies in native code. SIGTERM (the manager's stop) is passed on to
torchrun; whatever of the run is still alive after a grace period is killed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from studio_core import children, leases
from studio_core.hardware import pin_to_cpu_cores
from studio_core.monitor import SAMPLE_EVERY_S, RunMonitor
from studio_core.procs import kill_run_processes
from studio_core.runs import events as ev
from studio_core.runs.events import EventReader
from studio_core.runs.folder import EVENTS, LOG, read_launch

GRACE_S = 10
LOG_TAIL_LINES = 60


def main(run_dir: Path) -> int:
    launch = read_launch(run_dir)
    events = run_dir / EVENTS
    this_attempt = EventReader(events)
    this_attempt.read_new()  # a resumed run's folder holds earlier attempts' events: skip them
    stop_requested_at: float | None = None
    backend, cores = launch["hardware"]["backend"], launch["cores"]
    try:  # held until this process ends, after every process of the run has
        lease = leases.acquire(run_dir.parent, backend, cores, holder=run_dir.name, kind="run")
    except leases.CoresBusy as busy:  # taken between the manager's check and now
        ev.append(events, ev.error(str(busy)))
        ev.append(events, ev.status("failed"))
        return 1
    ev.append(events, ev.log(f"holding {backend} cores {cores}"))
    if backend == "cpu":
        pin_to_cpu_cores(cores)  # torchrun and every rank inherit the pinning

    torchrun = subprocess.Popen(launch["argv"], stdin=subprocess.DEVNULL, cwd=run_dir,
                                env=children.environment(launch["env"]))
    ev.append(events, ev.log(f"torchrun started (pid {torchrun.pid})"))
    monitor: RunMonitor | None = RunMonitor(backend, cores, torchrun.pid)  # hardware events, every ~2 s
    ev.append(events, ev.log(monitor.describe()))
    next_sample = time.monotonic() + SAMPLE_EVERY_S

    def on_stop(signum, frame):
        nonlocal stop_requested_at
        stop_requested_at = stop_requested_at or time.monotonic()
        torchrun.send_signal(signal.SIGTERM)  # torchrun passes it on to every rank

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
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
                ev.append(events, ev.hardware(monitor.sample()))
            except Exception as failed:  # sampling must never cost the run its final status
                ev.append(events, ev.log(f"hardware sampling stopped: {failed!r}"))
                monitor.stop()
                monitor = None
    if monitor is not None:
        monitor.stop()  # before the leftover check below: neuron-monitor carries the run's marker too
    stop_requested = stop_requested_at is not None
    left = kill_run_processes(os.environ["STUDIO_RUN_ID"])  # ranks torchrun did not reap
    if left:
        ev.append(events, ev.log(f"processes that survived SIGKILL: {[p.pid for p in left]}"))

    lease.release()
    attempt = this_attempt.read_new()
    saved_stop = any(e["type"] == "saved_stop" for e in attempt)
    if stop_requested or (code == 0 and saved_stop):  # stopped, by signal or with a checkpoint as asked
        ev.append(events, ev.status("stopped", exit_code=code))
    elif code == 0:
        ev.append(events, ev.status("finished", exit_code=0))
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
        ev.append(events, ev.status("failed", exit_code=code))
    return 0


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
