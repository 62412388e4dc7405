"""Finding and ending every process of a run, however it was started.

Each process of a run carries the environment variable STUDIO_RUN_ID (the planner sets
it; children inherit it), so a rank that lost its parent is still found by its marker.
"""

from __future__ import annotations

import ctypes
import os
import signal

import psutil

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when the thread that started it ends


def run_processes(run_id: str, same: tuple[str, ...] = ()) -> list[psutil.Process]:
    """Every live process that carries this run's STUDIO_RUN_ID marker and, of the variables in
    `same`, this process's own values (on Slurm: the same job step and task, which tells a node's
    processes from another node's, and from the batch script's srun, on one machine too)."""
    found, mine = [], {key: os.environ.get(key) for key in same}
    for proc in psutil.process_iter():
        try:
            env = proc.environ() if proc.status() != psutil.STATUS_ZOMBIE else {}
            if env.get("STUDIO_RUN_ID") == run_id and all(env.get(k) == v for k, v in mine.items()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # gone meanwhile, or another user's process: not one of ours
    return found


def kill_run_processes(run_id: str, same: tuple[str, ...] = ()) -> list[psutil.Process]:
    """SIGKILL every process of the run still there but this one (see run_processes for `same`);
    returns any that survive."""
    procs = [p for p in run_processes(run_id, same) if p.pid != os.getpid()]
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=5)
    return alive


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent ends, however it ends (Linux's
    PR_SET_PDEATHSIG). Call it in the child (e.g. as Popen's preexec_fn). If the parent is
    already gone (reparented to init before the call), `sig` is sent now."""
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent == 1 or os.getppid() != parent:  # orphaned before, or while, asking
        os.kill(os.getpid(), sig)
