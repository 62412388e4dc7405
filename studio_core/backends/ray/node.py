"""A node of a Ray run, as its supervisor sees it: the job's driver (job.py) starts one supervisor
per node of its placement group (studio_core.training.supervisor), with the node's place in the
run in its environment (NODE_ENV); the supervisor asks the run's backend for its node
(RayBackend.node). It holds no lease (Ray assigned the node's cores to the job, and the driver
put their ids in its environment for its ranks), runs its torchrun with the c10d rendezvous on the
first node, records its start and end (records.py), and only the first node writes the final
status, and only when the run finished or stopped as asked; otherwise the backend records how Ray
ended the job, once the job is over."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from studio_core.backends.base import Node
from studio_core.backends.ray.records import record_node

JOB_ENV, NODE_ENV, NODES_ENV = "STUDIO_RAY_JOB", "STUDIO_RAY_NODE", "STUDIO_RAY_NODES"
RESOURCES = {"neuron": "neuron_cores", "cuda": "GPU", "cpu": "CPU"}  # Ray's name for each device's cores
TASK = (JOB_ENV, NODE_ENV)  # what this node's processes share (two nodes may be one machine)


@dataclass(frozen=True)
class RayNode(Node):
    run_dir: Path
    name: str
    job_id: str
    nodes: int
    first: bool
    task_marker: tuple[str, ...] = TASK

    def prepare(self, argv: list[str]) -> list[str]:
        return [os.path.expandvars(arg) for arg in argv]  # $HEAD_ADDR, $RDZV_PORT, $STUDIO_RAY_JOB: the driver's

    def describe(self) -> str:
        return (f"Ray job {self.job_id} runs on {self.nodes} node(s); rendezvous at {os.environ['HEAD_ADDR']}:"
                f"{os.environ['RDZV_PORT']}")

    def restart_from(self, env: dict) -> dict | None:
        return None  # Ray does not restart a job's driver: a new attempt is a resume, from the studio

    def started(self) -> None:
        record_node(self.run_dir, self.job_id, self.name, started=time.time())

    def ended(self, exit_code: int, stopped: bool) -> None:
        record_node(self.run_dir, self.job_id, self.name, ended=time.time(), exit_code=exit_code, stopped=stopped)

    def left_to_place(self, exit_code: int, stopped: bool) -> str:
        if stopped:
            return f"Ray job {self.job_id} was asked to stop: torchrun exited with {exit_code}"
        return f"torchrun exited with code {exit_code}; the final status comes when Ray has ended job {self.job_id}"


def this_node(run_dir: Path) -> RayNode | None:
    """This node, when the supervisor was started by a Ray run's driver."""
    if JOB_ENV not in os.environ or NODE_ENV not in os.environ:
        return None
    rank = int(os.environ[NODE_ENV])
    return RayNode(Path(run_dir), f"n{rank}", os.environ[JOB_ENV], int(os.environ.get(NODES_ENV, "1")), rank == 0)
