"""Finding and ending every process of a run, however it was started.

Each process of a run carries the environment variable STUDIO_RUN_ID (the planner sets
it; children inherit it), so a rank that lost its parent is still found by its marker.
"""

from __future__ import annotations

import os

import psutil


def run_processes(run_id: str) -> list[psutil.Process]:
    """Every live process that carries this run's STUDIO_RUN_ID marker."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get("STUDIO_RUN_ID") == run_id:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # gone meanwhile, or another user's process: not one of ours
    return found


def kill_run_processes(run_id: str) -> list[psutil.Process]:
    """SIGKILL every process of the run still there (but this one); returns any that survive."""
    procs = [p for p in run_processes(run_id) if p.pid != os.getpid()]
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=5)
    return alive
