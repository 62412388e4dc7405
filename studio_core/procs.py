"""Finding and ending every process of a run, however it was started.

Each process of a run carries the environment variable STUDIO_RUN_ID (the planner sets
it; children inherit it), so a rank that lost its parent is still found by its marker.
"""

from __future__ import annotations

import os

import psutil


def run_processes(run_id: str, node: str | None = None) -> list[psutil.Process]:
    """Every live process that carries this run's STUDIO_RUN_ID marker (and, with `node`, that
    Slurm started on that node: SLURMD_NODENAME; a test cluster's nodes share one machine)."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ() if proc.status() != psutil.STATUS_ZOMBIE else {}
            if env.get("STUDIO_RUN_ID") == run_id and (node is None or env.get("SLURMD_NODENAME") == node):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # gone meanwhile, or another user's process: not one of ours
    return found


def kill_run_processes(run_id: str, node: str | None = None) -> list[psutil.Process]:
    """SIGKILL every process of the run still there but this one and its parents (on Slurm, the
    batch script and srun carry the marker too); returns any that survive."""
    me = psutil.Process()
    spared = {me.pid, *(parent.pid for parent in me.parents())}
    procs = [p for p in run_processes(run_id, node) if p.pid not in spared]
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=5)
    return alive
