"""A real Ray cluster on this machine, for the tests and the bench: a head and a second node.

`ray start --head --block` and `ray start --address HEAD --block` run here as two Ray nodes of one
cluster, each offering one CPU (so a 2-node run has one bundle on each). The second also declares
4 NeuronCores (`--resources '{"neuron_cores": 4}'`: how `ray start` takes them where it finds none
itself), which Ray assigns by id as on a trn node, so a run planned for Trainium goes there, its
ranks computing on the CPU. Every port is picked free when it starts and its session lives in a
private temporary folder, so two clusters (two test sessions) do not meet. The studio reaches it
through the head's dashboard (the Jobs API).

    cluster = RayCluster.start()        # its Jobs API answers, both nodes alive, when this returns
    cluster.address                     # http://127.0.0.1:PORT: give it to --ray
    cluster.stop()                      # by pid (the two blocking `ray start`), never `ray stop`
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).with_name("ray"))
# a node whose head is gone gives up on it after 15 s (Ray's default is 60 s), so a test of a
# restarted head does not wait a minute for the other node's raylet to end
ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_gcs_rpc_server_reconnect_timeout_s": "15"}
COMMON = ["--num-cpus=1", "--num-gpus=0", "--disable-usage-stats", "--block"]
NEURON_CORES = 4  # the second node's (index 1): a CPU run asks for none, so the other tests are as before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_port(named: set[int]) -> int:
    """A port free now and not yet named by this cluster (a port named for a node that is down, or
    for workers not started yet, is free to the system but not to us), added to `named`."""
    while (port := free_port()) in named:
        continue
    named.add(port)
    return port


def node_ports(named: set[int]) -> list[str]:
    """A node's own ports, none of them named before for this cluster (Ray refuses to start a node
    whose ports meet another component's, and two nodes of one machine must not share them); the
    41 ports its workers take are named too."""
    worker = free_port()
    while named.intersection(range(worker, worker + 41)):
        worker = free_port()
    named.update(range(worker, worker + 41))
    return [f"--node-manager-port={pick_port(named)}", f"--object-manager-port={pick_port(named)}",
            f"--dashboard-agent-listen-port={pick_port(named)}",
            f"--dashboard-agent-grpc-port={pick_port(named)}", f"--metrics-export-port={pick_port(named)}",
            f"--runtime-env-agent-port={pick_port(named)}", f"--min-worker-port={worker}",
            f"--max-worker-port={worker + 40}"]


@dataclass
class RayCluster:
    folder: Path  # the session's temporary folder (short: Ray's sockets live under it)
    gcs_port: int
    dashboard_port: int
    named: set[int]  # every port named for this cluster so far: no later pick takes one of them
    nodes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @classmethod
    def start(cls, timeout: float = 120) -> RayCluster:
        named: set[int] = set()
        cluster = cls(Path(tempfile.mkdtemp(prefix="ray", dir="/tmp")), pick_port(named), pick_port(named), named)
        try:
            cluster.nodes.append(cluster._popen(cluster._head_argv(), 0))
            cluster.wait(1, timeout)
            cluster.nodes.append(cluster._popen(cluster._worker_argv(), 1))
            cluster.wait(2, timeout)
        except BaseException:
            cluster.stop()  # a node that did not start leaves nothing of the other
            raise
        return cluster

    def _head_argv(self) -> list[str]:
        return [RAY, "start", "--head", f"--port={self.gcs_port}", "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}", f"--ray-client-server-port={pick_port(self.named)}",
                f"--temp-dir={self.folder}", *node_ports(self.named), *COMMON]

    def _worker_argv(self) -> list[str]:
        return [RAY, "start", f"--address=127.0.0.1:{self.gcs_port}", *node_ports(self.named),
                f"--resources={json.dumps({'neuron_cores': NEURON_CORES})}", *COMMON]

    def kill_node(self, index: int) -> None:
        """A node goes down at once: SIGKILL to its `ray start` and everything it started (its raylet,
        its workers and what they run: a run's supervisor, torchrun and ranks on that node)."""
        node = psutil.Process(self.nodes[index].pid)
        tree = [node, *node.children(recursive=True)]
        for proc in tree:
            try:
                proc.kill()
            except psutil.NoSuchProcess:  # it ended between the listing and its kill (a short-lived helper)
                continue
        psutil.wait_procs(tree, timeout=30)
        self.nodes[index].wait()

    def restart_node(self, index: int, timeout: float = 120) -> None:
        """A killed node that is not the head joins again (as a new Ray node); the cluster has all
        its nodes alive."""
        self.nodes[index] = self._popen(self._worker_argv(), index)
        self.wait(len(self.nodes), timeout)

    def restart_head(self, timeout: float = 120) -> None:
        """A killed head starts again on its same ports: a new cluster, which knows none of the old
        one's jobs. The other node gives up on the old head (15 s here, ENV), its `ray start` ends
        with everything it ran, and it joins the new head, as KubeRay restarts a worker pod."""
        # else `ray start --head` takes the other node's raylet (its --gcs-address flag) for a
        # head still running at the address this folder last recorded, and refuses to start
        (self.folder / "ray_current_cluster").unlink(missing_ok=True)
        self.nodes[0] = self._popen(self._head_argv(), 0)
        self.nodes[1].wait(timeout)
        self.nodes[1] = self._popen(self._worker_argv(), 1)
        self.wait(2, timeout)

    def _popen(self, argv: list[str], index: int) -> subprocess.Popen:
        log = open(self.folder / f"node{index}.log", "ab")
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **ENV}, start_new_session=True)

    def alive_nodes(self) -> int:
        from ray.util.state import list_nodes

        try:
            return sum(n.state == "ALIVE" for n in list_nodes(address=self.address))
        except Exception:  # the dashboard is not up yet: no node to count
            return 0

    def wait(self, nodes: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.alive_nodes() < nodes:
            for node in self.nodes:
                assert node.poll() is None, (self.folder / "node0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"Ray: {nodes} node(s) not alive after {timeout} s"
            time.sleep(1)

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster: the two `ray start` and all they started."""
        found = []
        for node in self.nodes:
            try:
                parent = psutil.Process(node.pid)
                found += [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        return found

    def stop(self) -> None:
        """SIGTERM to each blocking `ray start` (it ends its node's daemons), then SIGKILL what is left."""
        left = self.processes()
        for node in reversed(self.nodes):
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(left, timeout=30)
        for proc in alive:
            proc.kill()
        psutil.wait_procs(alive, timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)
