"""Finding and ending every process of a run, however it was started.

Each process of a run carries the environment variable STUDIO_RUN_ID (the planner sets
it; children inherit it), so a rank that lost its parent is still found by its marker.
"""

from __future__ import annotations

import os

import psutil


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
