"""What a Slurm run keeps in its folder about its jobs: slurm.json (the job of each attempt,
written by the studio and by the job itself) and slurm-nodes/ (each node supervisor's start and
end), read by the backend to say how a job ended and which node failed first."""

from __future__ import annotations

import re
import socket
import sys
from pathlib import Path

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


def job_of(run_dir: Path) -> str | None:
    """The Slurm job id of the run's current attempt, or None before it is submitted."""
    job_id = read_json(run_dir / JOB).get("job_id")
    return str(job_id) if job_id else None


def submitted(run_dir: Path) -> float:
    """When the run's current job was submitted (0 when unknown)."""
    return float(read_json(run_dir / JOB).get("submitted", 0))


def record_node(run_dir: Path, job_id: str, node: str, **fields) -> None:
    """A node supervisor's record of its start (started=time) or its end (ended=time, exit_code,
    stopped): one file per job and node, so that a supervisor killed, or on a node that died,
    leaves a start without an end, and the backend can name the node whose failure came first.
    A record that cannot be written is said in the node's log; the run goes on without it."""
    path = Path(run_dir) / NODES / f"{job_id}.{re.sub(r'[^A-Za-z0-9_.-]', '_', node)}.json"
    try:
        path.parent.mkdir(exist_ok=True)
        before = {} if "started" in fields else read_json(path)  # a restarted step (auto-resume) starts anew
        write_json(path, {**before, "node": node, "host": socket.gethostname(), "job_id": str(job_id), **fields})
    except OSError as error:
        print(f"studio: node {node}'s record ({path}) not written: {error}", file=sys.stderr, flush=True)


def node_records(run_dir: Path, job_id: str) -> list[dict]:
    """The node supervisors' records of this job (record_node), first started first."""
    found = [read_json(path) for path in sorted((Path(run_dir) / NODES).glob(f"{job_id}.*.json"))]
    return sorted((r for r in found if r.get("job_id") == str(job_id)), key=lambda r: r.get("started", 0))


def first_failed_node(records: list[dict]) -> str | None:
    """Which node's failure came first, from the node supervisors' records of a failed job of
    several nodes, in words (None when they cannot tell). A supervisor that never recorded its
    end was killed or lost its node: it went first, since the others' ends (a torchrun whose
    ranks lost their peers) follow from it; when every node ended, the first that failed (a
    non-zero exit without a stop asked) did."""
    if len(records) < 2:
        return None

    def name(record: dict) -> str:
        node, host = record.get("node", "?"), record.get("host")
        return f"node {node}" + (f" (host {host})" if host and host != node else "")

    silent = [r for r in records if "ended" not in r]
    if silent and len(silent) < len(records):
        nodes = ", ".join(name(r) for r in silent)
        return (f"{nodes} failed first: its supervisor ended without recording its end (it crashed, was killed, "
                "or its node went down) while the other nodes' supervisors went on")
    if silent:
        return None  # every supervisor was ended at once: nothing tells which went first
    failed = sorted((r for r in records if r.get("exit_code") not in (0, None) and not r.get("stopped")),
                    key=lambda r: r["ended"])
    if not failed:
        return None
    return f"{name(failed[0])} failed first: its torchrun exited with code {failed[0]['exit_code']}"
