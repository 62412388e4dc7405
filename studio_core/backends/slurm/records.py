"""What a Slurm run keeps in its folder about its jobs: slurm.json (the job of each attempt,
written by the studio and by the job itself) and slurm-nodes/ (each node supervisor's start and
end), read by the backend to say how a job ended and which node failed first.

A run's job id is what Slurm's commands (squeue -j, scontrol show job, scancel) take for it: a
plain job's number (`123`), or for a task of a job array (a sweep's runs, array.py) the array's
id and the task's index (`123_4`). Inside such a task SLURM_JOB_ID is the task's own number,
which no command of the studio's names it by: `job_in` gives the id the run records.
"""

from __future__ import annotations

from pathlib import Path

from studio_core.backends import nodes
from studio_core.rundir.folder import read_json, write_json

SCRIPT = "slurm.sh"
NODES = "slurm-nodes"  # a record per job and node (record_node): node, host, job_id, started, ended, exit_code, stopped
JOB = "slurm.json"  # {"job_id": the current attempt's, "job_ids": every attempt's, "submitted": time}


def record_job(run_dir: Path, job_id: str, when: float) -> bool:
    """slurm.json names `job_id` as the run's current job, after its earlier ones. Both the studio
    (once sbatch answers) and the job itself (when it starts) record it: whichever comes second
    finds it there and keeps the first one's time. -> whether this call wrote it."""
    job_id = str(job_id)
    before = read_json(run_dir / JOB)
    if str(before.get("job_id")) == job_id:
        return False
    earlier = [str(i) for i in before.get("job_ids", []) if str(i) != job_id]
    write_json(run_dir / JOB, {"job_id": job_id, "job_ids": [*earlier, job_id], "submitted": when})
    return True


def job_in(environ) -> str | None:
    """The id a running job records itself by, from its environment: in a task of a job array
    `<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>` (123_4), else SLURM_JOB_ID (None outside a Slurm
    job). An array task's SLURM_JOB_ID is its own unique number, not the id the studio recorded."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return environ.get("SLURM_JOB_ID") or None


def job_of(run_dir: Path) -> str | None:
    """The Slurm job id of the run's current attempt, or None before it is submitted."""
    job_id = read_json(run_dir / JOB).get("job_id")
    return str(job_id) if job_id else None


def submitted(run_dir: Path) -> float:
    """When the run's current job was submitted (0 when unknown)."""
    return float(read_json(run_dir / JOB).get("submitted", 0))


def record_node(run_dir: Path, job_id: str, node: str, **fields) -> None:
    """This job's node `node` records its start or end (nodes.record_node) in slurm-nodes/."""
    nodes.record_node(Path(run_dir) / NODES, job_id, node, **fields)


def node_records(run_dir: Path, job_id: str) -> list[dict]:
    """The node supervisors' records of this job, first started first."""
    return nodes.node_records(Path(run_dir) / NODES, job_id)
