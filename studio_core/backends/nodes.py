"""The records the node supervisors of a cluster run keep in its folder (slurm-nodes/, ray-nodes/):
each node's start and end, one file per job and node, from which a failed job of several nodes
says which node failed first (not the knock-on errors the others saw)."""

from __future__ import annotations

import re
import socket
import sys
from pathlib import Path

from studio_core.rundir.folder import read_json, write_json


def record_node(folder: Path, job_id: str, node: str, **fields) -> None:
    """A node supervisor's record of its start (started=time) or its end (ended=time, exit_code,
    stopped): one file per job and node, so that a supervisor killed, or on a node that died,
    leaves a start without an end, and the backend can name the node whose failure came first.
    A record that cannot be written is said in the node's log; the run goes on without it."""
    path = Path(folder) / f"{job_id}.{re.sub(r'[^A-Za-z0-9_.-]', '_', node)}.json"
    try:
        path.parent.mkdir(exist_ok=True)
        before = {} if "started" in fields else read_json(path)  # a restarted step (auto-resume) starts anew
        write_json(path, {**before, "node": node, "host": socket.gethostname(), "job_id": str(job_id), **fields})
    except OSError as error:
        print(f"studio: node {node}'s record ({path}) not written: {error}", file=sys.stderr, flush=True)


def node_records(folder: Path, job_id: str) -> list[dict]:
    """The node supervisors' records of this job (record_node), first started first."""
    found = [read_json(path) for path in sorted(Path(folder).glob(f"{job_id}.*.json"))]
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
