"""What a Ray run keeps in its folder about its jobs: ray.json (the job of each attempt) and
ray-nodes/ (each node supervisor's start and end), read by the backend to say how a job ended
and which node failed first."""

from __future__ import annotations

from pathlib import Path

from studio_core.backends import nodes
from studio_core.rundir.folder import read_json, write_json

JOB = "ray.json"  # {"job_id": the current attempt's, "job_ids": every attempt's, "address", "submitted"}
NODES = "ray-nodes"  # a record per job and node (nodes.record_node): node, host, job_id, started, ended, ...


def record_job(run_dir: Path, job_id: str, address: str, when: float) -> None:
    before = read_json(run_dir / JOB)
    earlier = [i for i in before.get("job_ids", []) if i != job_id]
    write_json(run_dir / JOB, {"job_id": job_id, "job_ids": [*earlier, job_id], "address": address,
                               "submitted": when})


def job_of(run_dir: Path) -> tuple[str | None, str | None]:
    """(the Ray job id of the run's current attempt, the address it went to); Nones before it is submitted."""
    record = read_json(run_dir / JOB)
    return record.get("job_id"), record.get("address")


def submitted(run_dir: Path) -> float:
    return float(read_json(run_dir / JOB).get("submitted", 0))


def record_node(run_dir: Path, job_id: str, node: str, **values) -> None:
    """This job's node `node` records its start or end (nodes.record_node) in ray-nodes/."""
    nodes.record_node(Path(run_dir) / NODES, job_id, node, **values)


def node_records(run_dir: Path, job_id: str) -> list[dict]:
    """The node supervisors' records of this job, first started first."""
    return nodes.node_records(Path(run_dir) / NODES, job_id)
