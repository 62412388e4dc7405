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

Each actor asks for its bundle's NeuronCores (or GPUs) itself (`claim`), so Ray assigns it their
ids, and those ids become the node's cores, handed to its ranks by the variables a local run's
leased cores use (`node_cores`): two Ray runs on one node never share a core, and the log says
which ids each node got. Ray sets NEURON_RT_VISIBLE_CORES (CUDA_VISIBLE_DEVICES) only in a task or
actor that asks for `neuron_cores` (`GPU`) itself; an actor that asks for none gets no ids, and its
node's ranks fell back to cores 0..n-1, whatever else ran there.

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
from studio_core.machine.device_env import RANK_CORES, VISIBLE
from studio_core.machine.procs import die_with_parent
from studio_core.rundir import events
from studio_core.rundir.folder import EVENTS, LOG, read_launch

def bundle(device: str, nproc: int) -> dict[str, float]:
    """What one node of the run asks Ray for: its processes' cores of the run's device."""
    return {RESOURCES[device]: float(nproc)}


def claim(device: str, nproc: int) -> dict:
    """What a node's actor asks for out of its bundle (its `.options()`): the bundle's NeuronCores
    or GPUs, so that Ray assigns their ids to it. The placement group only reserves them: Ray gives
    ids to a task or actor for what it asks itself, and sets NEURON_RT_VISIBLE_CORES
    (CUDA_VISIBLE_DEVICES) only for a resource it got ids of (Ray 2.60 source:
    python/ray/_private/worker.py, get_accelerator_ids_for_accelerator_resource, and
    python/ray/_private/utils.py, set_visible_accelerator_ids). `neuron_cores` goes in
    `resources`, as in Ray's own Neuron example; Ray takes GPUs as num_gpus only. On CPU nothing:
    Ray counts CPUs but gives them no ids (only GPU is a unit-instance resource among its own,
    `predefined_unit_instance_resources` in src/ray/common/ray_config_def.h), so asking would give
    the ranks no CPU set of their own, and the bundle already holds the node's CPUs for the run."""
    if device == "neuron":
        return {"resources": {RESOURCES[device]: nproc}}
    if device == "cuda":
        return {"num_gpus": nproc}
    return {}


def node_cores(device: str, ids: list[str], nproc: int) -> dict[str, str]:
    """The environment that puts a node's ranks on the ids Ray assigned its actor, by the same
    variables a local run's leased cores use (machine/device_env.py, `device_env`): on Neuron one
    core per rank, NEURON_RT_VISIBLE_CORES for one process, else the node's block in
    STUDIO_NEURON_CORES, of which each rank keeps block[LOCAL_RANK] before torch loads
    (`use_rank_core`, in the worker); CUDA_VISIBLE_DEVICES on CUDA. Nothing on CPU.
    RuntimeError when Ray assigned other than one id per process."""
    if device not in ("neuron", "cuda"):
        return {}
    if len(ids) != nproc:
        raise RuntimeError(f"Ray assigned this node's actor {RESOURCES[device]} {ids}, not one per process "
                           f"({nproc}): check the node's {RESOURCES[device]} and the visible-cores variable "
                           "its Ray was started with")
    if device == "cuda":
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}
    return {VISIBLE: ids[0]} if nproc == 1 else {RANK_CORES: ",".join(ids)}


@ray.remote(num_cpus=0, max_concurrency=2)  # run() waits while stop() may be called
class NodeSupervisor:
    def __init__(self):
        self.process: subprocess.Popen | None = None

    def cores(self, resource: str) -> list[str]:
        """The ids of `resource` Ray assigned this actor, in numeric order (Ray 2.60 source:
        python/ray/runtime_context.py, get_accelerator_ids: the ids of the actor's own request, also
        inside a placement group; python/ray/_private/worker.py maps them to the node's own ids
        when the worker inherited NEURON_RT_VISIBLE_CORES or CUDA_VISIBLE_DEVICES). A node's
        `neuron_cores`, found by Ray from neuron-ls (python/ray/_private/accelerators/neuron.py)
        or declared with `ray start --resources`, are ids 0..N-1: Ray treats `neuron_cores` as a
        unit-instance resource, each unit its own id (`custom_unit_instance_resources` in
        src/ray/common/ray_config_def.h; also in the raylet binary of the ray==2.60.0 wheel)."""
        ids = ray.get_runtime_context().get_accelerator_ids().get(resource, [])
        return sorted(ids, key=lambda i: (len(i), i))  # a set in Ray: "10" after "9"

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
    device = launch["hardware"]["backend"]
    supervisors = [NodeSupervisor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=i), **claim(device, nproc)).remote() for i in range(nodes)]
    head, port = ray.get(supervisors[0].rendezvous.remote())
    assigned = ray.get([supervisor.cores.remote(RESOURCES[device]) for supervisor in supervisors])
    try:
        placed = [node_cores(device, ids, nproc) for ids in assigned]
    except RuntimeError as error:
        events.append(run_dir / EVENTS, events.error(f"Ray job {job_id}: {error}"))
        return 1
    if device != "cpu":
        events.append(run_dir / EVENTS, events.log(f"Ray job {job_id}: " + "; ".join(
            f"node n{i} has {RESOURCES[device]} {','.join(ids)}" for i, ids in enumerate(assigned))))

    def on_stop(signum, frame):
        for supervisor in supervisors:
            supervisor.stop.remote()

    signal.signal(signal.SIGTERM, on_stop)
    base = dict(os.environ)
    runs = [supervisor.run.remote(str(run_dir), {**base, **placed[i], JOB_ENV: job_id, NODE_ENV: str(i),
                                                 NODES_ENV: str(nodes), "STUDIO_RAY_HOST": str(i == 0).lower(),
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
