"""The batch job's first step, as the batch script runs it on the job's first node, before srun:

    python -m studio_core.backends.slurm.job_start RUN_DIR SCRIPT <<'STUDIO_RUN_RECORDS' ... (the run's records)

On the run's first start by plain `sbatch` (an exported script) it makes the run folder from the
records on stdin (spec.yaml, launch.json, carried in the script), so `launch.py runs`, the Runs
tab and `launch.py stop` treat it as a run the studio submitted; every start records its job in
slurm.json (as 123_4 in a task of a job array: records.job_in).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from studio_core.backends.slurm.records import JOB, SCRIPT, job_in, record_job
from studio_core.rundir import events, folder


def job_start(run_dir: str, script: str = "") -> int:
    """On the run's first start by plain `sbatch`, the run folder made from the records on stdin,
    under a temporary name and renamed when whole (with a copy of `script`, the job's own, as
    slurm.sh); then this job recorded in slurm.json. A start the studio made (the folder written
    before sbatch, or a resume) finds the folder and records the job only, so the studio's script
    and the exported one are the same text. Refused (exit 2, the reason in the job's Slurm
    output): a run that has ended, or one another job already started (the script submitted twice)."""
    run_dir = Path(run_dir)
    job_id = job_in(os.environ)  # a task of a job array (a sweep's run) is its array's 123_4
    if not job_id:
        return _refuse("this is a Slurm batch script: submit it with `sbatch FILE` (run by bash alone, it has no "
                       "Slurm job and nodes to run on)")
    records = json.loads(sys.stdin.read())
    if folder.is_run(run_dir):
        problem = _taken(run_dir, job_id)
        if problem:
            return _refuse(problem)
    else:
        problem = _make(run_dir, records, job_id, script)
        if problem:
            return _refuse(problem)
    record_job(run_dir, job_id, time.time())
    print(f"studio: Slurm job {job_id} runs run {run_dir.name}; its output goes to {run_dir / folder.LOG}",
          flush=True)
    return 0


def _make(run_dir: Path, records: dict, job_id: str, script: str) -> str | None:
    """The run folder of a first start by plain sbatch; what stands in the way, else None."""
    tmp = run_dir.parent / f"{folder.CREATING}{run_dir.name}"
    try:
        tmp.mkdir(parents=True)
    except FileExistsError:
        return (f"another job is making run {run_dir.name}'s folder now: this script was submitted twice, and "
                f"only the first job runs it; job {job_id} ends here")
    try:
        folder.write_new_run(tmp, "\n".join(records["spec.yaml"]) + "\n", records["launch.json"], created=time.time())
        events.append(tmp / folder.EVENTS, events.log(f"started by sbatch, outside the studio, as Slurm job {job_id} "
                                                      "(an exported batch script)"))
        record_job(tmp, job_id, time.time())
        if script and Path(script).is_file():  # the job's copy of its script: what a submitted run keeps
            shutil.copyfile(script, tmp / SCRIPT)
        tmp.rename(run_dir)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if run_dir.exists() and not folder.is_run(run_dir):
            return (f"{run_dir} is there but holds no run (no {folder.SPEC}): move it away, or export the script "
                    "again (a new run id)")
        return f"cannot make the run folder {run_dir} ({error}): give the runs folder a place this job can write to"
    return None


def _taken(run_dir: Path, job_id: str) -> str | None:
    """Why this job may not start the run already in `run_dir`, else None: the run has ended, or
    its current attempt (since its last "starting") is another job's."""
    found = events.read(run_dir / folder.EVENTS)
    state = events.fold(found).state
    if state in events.FINAL_STATES:
        return (f"run {run_dir.name} has ended ({state}): a batch script starts its run once. Export a new "
                f"script for a new run, or go on from its last checkpoint with `launch.py train --resume "
                f"{run_dir.name}`")
    recorded = folder.read_json(run_dir / JOB)
    other = str(recorded.get("job_id") or "")
    starts = [e.get("time", 0) for e in found if e.get("type") == "status" and e.get("state") == "starting"]
    if other and other != job_id and starts and float(recorded.get("submitted", 0)) >= starts[-1]:
        return (f"run {run_dir.name} is already Slurm job {other}'s: this script was submitted twice, and only "
                f"the first job runs it; job {job_id} ends here")
    return None


def _refuse(reason: str) -> int:
    print(f"studio: not started: {reason}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(job_start(*sys.argv[1:]))
