"""A node of a Slurm run, as its supervisor sees it: the batch script's `srun` starts one
supervisor per node (studio_core.training.supervisor), which asks the run's backend for its
node (SlurmBackend.node). It holds no lease (the job has its nodes to itself), sets the c10d
rendezvous on the first node for its torchrun, tags its hardware samples with the node, records
its start and end (records.record_node), and only the first node writes the final status, and
only when the run finished or stopped as asked. When Slurm ends the job (scancel, time limit) or
the run fails (a node may have died), it writes none: the backend records the ending, with
Slurm's reason, once the job is gone."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from studio_core.backends.base import Node
from studio_core.backends.slurm import tools
from studio_core.backends.slurm.records import JOB, job_in, record_node
from studio_core.rundir.checkpoints import list_checkpoints
from studio_core.rundir.folder import read_json

TASK = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID")  # what this node's task's processes share
RDZV_BASE_PORT = 29500  # a job's rendezvous port: this plus its job id modulo 1000
AUTO_RESUME_ENV = "STUDIO_AUTO_RESUME"  # "1": the job's srun restarts its step after a node failure (HyperPod)


@dataclass(frozen=True)
class SlurmNode(Node):
    run_dir: Path
    name: str  # this node's Slurm name
    names: str  # the job's nodes, as Slurm writes them (n[1-2])
    job_id: str  # the run's record of its job (records.job_in): 123, or 123_4 in a task of a job array
    first: bool  # the first node: the rendezvous host, and the one that writes the final status
    task_marker: tuple[str, ...] = TASK
    number: str = ""  # SLURM_JOB_ID: Slurm's own number for this job, an array task's its own (the port's)

    def prepare(self, argv: list[str]) -> list[str]:
        os.environ.update(rendezvous(self))
        return [os.path.expandvars(arg) for arg in argv]  # $HEAD_ADDR, $RDZV_PORT, $SLURM_JOB_ID

    def describe(self) -> str:
        return (f"Slurm job {self.job_id} runs on {self.names}; rendezvous at {os.environ['HEAD_ADDR']}:"
                f"{os.environ['RDZV_PORT']}")

    def restart_from(self, env: dict) -> dict | None:
        return auto_resumed(self.run_dir, env)

    def started(self) -> None:
        record_node(self.run_dir, self.job_id, self.name, started=time.time())  # which node failed first

    def ended(self, exit_code: int, stopped: bool) -> None:
        record_node(self.run_dir, self.job_id, self.name, ended=time.time(), exit_code=exit_code, stopped=stopped)

    def left_to_place(self, exit_code: int, stopped: bool) -> str:
        if stopped:
            return f"Slurm asked job {self.job_id} to end (SIGTERM): torchrun exited with {exit_code}"
        return f"torchrun exited with code {exit_code}; the final status comes when Slurm has ended job {self.job_id}"


def this_node(run_dir: Path) -> SlurmNode | None:
    """This node, when the supervisor runs as a task of a Slurm job. Its records are kept under
    the id the run recorded (records.job_in: 123_4 in a task of a job array), as the backend reads them."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    return SlurmNode(Path(run_dir), os.environ.get("SLURMD_NODENAME", "?"), os.environ.get("SLURM_JOB_NODELIST", "?"),
                     job_in(os.environ), os.environ.get("SLURM_NODEID", "0") == "0", number=os.environ["SLURM_JOB_ID"])


def rendezvous(node: SlurmNode) -> dict[str, str]:
    """HEAD_ADDR (the first node's address, as Slurm knows it: NodeAddr) and RDZV_PORT for torchrun:
    from Slurm's own job number, which differs between the tasks of a job array that may run side by
    side (their recorded ids, 123_4 and 123_5, are no number)."""
    return {"HEAD_ADDR": tools.first_node_address(node.names),
            "RDZV_PORT": str(RDZV_BASE_PORT + int(node.number or node.job_id) % 1000)}


def auto_resumed(run_dir: Path, env: dict) -> dict | None:
    """With HyperPod's auto-resume, the job's step starts again after a node failure: the newest
    checkpoint this job saved (one newer than its submission), to go on from; None on a first start."""
    if env.get(AUTO_RESUME_ENV) != "1":
        return None
    submitted = read_json(run_dir / JOB).get("submitted", time.time())
    saved = [c for c in list_checkpoints(run_dir) if Path(c["path"]).stat().st_mtime > submitted]
    return saved[-1] if saved else None
