"""The driver of a Ray run: the entrypoint of the Ray job the backend submits (an entry point,
never imported by the studio itself).

It asks Ray for the run's nodes as a placement group: one bundle per node of the run's device
resource (`neuron_cores` on Trainium, `GPU` on CUDA, `CPU` here) times the processes per node,
spread one bundle per node (STRICT_SPREAD), and waits until Ray has placed them (the log says so
while it waits). On each bundle's node an actor starts that node's supervisor
(`python -m studio_core.training.supervisor RUN_DIR`, as a local or Slurm run has), with the
node's place in the run and the rendezvous (the first node's address and a free port there) in
its environment, and the run's output appended to the folder's train.log. The job ends when every
supervisor has, with exit code 1 when a node's torchrun failed (Ray then calls the job FAILED).

When Ray stops the job (`ray job stop`, or the studio's Stop), Ray sends this process SIGTERM: it
passes SIGTERM on to every node's supervisor, which ends its torchrun and ranks as on a local stop.
Ray kills the actors when this process ends; each supervisor was started to get SIGTERM then
(PR_SET_PDEATHSIG), so none outlives the job.

The run folder, this repository and the compile cache must be on storage every node sees.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from studio_core.backends.ray.node import JOB_ENV, NODE_ENV, NODES_ENV, RESOURCES
from studio_core.backends.ray.records import node_records
from studio_core.machine.procs import die_with_parent
from studio_core.rundir import events
from studio_core.rundir.folder import EVENTS, LOG, read_launch

def bundle(device: str, nproc: int) -> dict[str, float]:
    """What one node of the run asks Ray for: its processes' cores of the run's device."""
    return {RESOURCES[device]: float(nproc)}


@ray.remote(num_cpus=0, max_concurrency=2)  # run() waits while stop() may be called
class NodeSupervisor:
    def __init__(self):
        self.process: subprocess.Popen | None = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a port free on it, for the run's c10d rendezvous."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def run(self, run_dir: str, env: dict) -> int:
        with open(Path(run_dir) / LOG, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "studio_core.training.supervisor", run_dir],
                                            cwd=run_dir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT,
                                            preexec_fn=lambda: die_with_parent(signal.SIGTERM))
            return self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)


def main(run_dir: Path, job_id: str) -> int:
    launch = read_launch(run_dir)
    argv = launch["argv"]
    nodes = next(int(a.split("=", 1)[1]) for a in argv if a.startswith("--nnodes="))
    nproc = next(int(a.split("=", 1)[1]) for a in argv if a.startswith("--nproc-per-node="))
    wanted = bundle(launch["hardware"]["backend"], nproc)
    ray.init()  # the cluster this job runs on
    group = placement_group([wanted] * nodes, strategy="STRICT_SPREAD")
    events.append(run_dir / EVENTS, events.log(f"Ray job {job_id}: waiting for {nodes} node(s) with {wanted} each"))
    while not ray.wait([group.ready()], timeout=5)[0]:
        pass  # PENDING in the studio's words: Ray's own status says which resources are missing
    supervisors = [NodeSupervisor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=i)).remote() for i in range(nodes)]
    head, port = ray.get(supervisors[0].rendezvous.remote())

    def on_stop(signum, frame):
        for supervisor in supervisors:
            supervisor.stop.remote()

    signal.signal(signal.SIGTERM, on_stop)
    base = dict(os.environ)
    runs = [supervisor.run.remote(str(run_dir), {**base, JOB_ENV: job_id, NODE_ENV: str(i), NODES_ENV: str(nodes), "STUDIO_RAY_HOST": str(i == 0).lower(),
                                                 "HEAD_ADDR": head, "RDZV_PORT": str(port)})
            for i, supervisor in enumerate(supervisors)]
    pending = list(runs)
    while pending:  # in short waits, so that SIGTERM's handler runs at once
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=1)
    ray.get(runs)
    failed = [r for r in node_records(run_dir, job_id) if r.get("exit_code") not in (0, None) and not r.get("stopped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
