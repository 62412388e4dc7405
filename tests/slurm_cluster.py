"""A real Slurm cluster on this machine, for the tests and the bench: a 2-node partition.

Debian's Slurm runs one controller (slurmctld) and compute daemons (`slurmd -N n1`,
`slurmd -N n2`, ...) on localhost: "nodes" whose jobs really get one `srun` task per node,
so a 2-node torchrun rendezvous really happens. Everything lives in one private folder (its
state, spool, logs, pids and slurm.conf); the ports are picked free when it starts, and its job
ids start at a random number (a job's rendezvous port comes from its id), so two clusters
(two test sessions) do not meet. Slurm's commands find it through SLURM_CONF.

    cluster = SlurmCluster.start(folder)      # sinfo answers when this returns
    cluster.env                                # {"SLURM_CONF": ...}: give it to the studio
    cluster.stop()                             # by pid, never by name

Needs root (the daemons run as root here, as in CI), Debian's `slurm-wlm` and `munge`.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

NODES = ("n1", "n2", "n3")  # n1 and n2 make the default partition trn; n3 alone is partition short
CONF = """\
ClusterName=studio-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/log/ctld.log
SlurmdLogFile={d}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=5
SlurmdTimeout=10
MinJobAge=600
FirstJobId={first_job}
{nodes}
PartitionName=trn Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=short Nodes=n3 MaxTime=INFINITE State=UP OverSubscribe=YES
"""
NODE = "NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=2 RealMemory=8000 State=UNKNOWN"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def available() -> bool:
    return all(shutil.which(tool) for tool in ("sbatch", "slurmctld", "slurmd", "munged"))


def start_munge() -> None:
    """munged, once per machine (Slurm authenticates every request through it)."""
    if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
        return
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"], check=True)


@dataclass
class SlurmCluster:
    folder: Path

    def __post_init__(self):
        self.folder = Path(self.folder)

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    @classmethod
    def start(cls, folder: Path, timeout: float = 60) -> SlurmCluster:
        folder = Path(folder)
        for sub in ("state", "log", *[f"spool/{n}" for n in NODES]):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(NODE.format(name=n, port=free_port()) for n in NODES)
        (folder / "slurm.conf").write_text(CONF.format(d=folder, ctld_port=free_port(), slurmd_port=free_port(),
                                                       nodes=nodes,
                                                       first_job=random.randrange(1000, 100_000)))
        cluster = cls(folder)
        start_munge()
        env = {**os.environ, **cluster.env}
        subprocess.run(["slurmctld", "-f", str(cluster.conf), "-i"], env=env, check=True)
        for name in NODES:
            cluster.start_node(name)
        try:
            cluster.wait_idle(timeout)
        except TimeoutError:
            cluster.stop()
            raise RuntimeError(f"the test Slurm cluster did not come up: see {folder / 'log'}") from None
        return cluster

    def start_node(self, name: str) -> None:
        subprocess.run(["slurmd", "-f", str(self.conf), "-N", name], env={**os.environ, **self.env}, check=True)

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=30)

    def idle_nodes(self) -> int:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
        return sum(1 for line in out if line.strip().endswith("idle"))

    def pid(self, daemon: str) -> int | None:
        try:
            return int((self.folder / f"{daemon}.pid").read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None

    def kill(self, *daemons: str, sig: int = signal.SIGTERM) -> None:
        """Signal daemons by their pid files ("slurmctld", "slurmd.n1"), all at once, and wait up
        to 10 s for them to end. (One after another, each slurmd took about 2 s to end and then
        slurmctld 5 s; signalled together, all four were gone in 1.7 s.)"""
        pids = []
        for pid in filter(None, map(self.pid, daemons)):
            try:
                os.kill(pid, sig)
                pids.append(pid)
            except ProcessLookupError:
                continue
        for _ in range(100):
            if not any(map(psutil.pid_exists, pids)):
                return
            time.sleep(0.1)

    def processes(self, node: str | None = None) -> list[psutil.Process]:
        """What this cluster started and still runs (on `node`, or on every node): the step
        daemons (slurmstepd, found by their working folder and their node's log) and the jobs'
        processes (found by SLURM_CONF and SLURMD_NODENAME in their environment)."""
        found = []
        log = f"slurmd.{node}.log" if node else "slurmd."
        for proc in psutil.process_iter():
            try:
                if "slurmstepd" in proc.name() and proc.cwd().startswith(str(self.folder)):
                    if any(log in f.path for f in proc.open_files()):
                        found.append(proc)
                    continue
                env = proc.environ()
                if env.get("SLURM_CONF") == str(self.conf) and "SLURM_JOB_ID" in env and (
                        node is None or env.get("SLURMD_NODENAME") == node):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def kill_node(self, node: str) -> None:
        """The node dies: its slurmd and everything running on it, SIGKILLed at once."""
        victims = self.processes(node)
        self.kill(f"slurmd.{node}", sig=signal.SIGKILL)
        for proc in victims:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(victims, timeout=10)

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.idle_nodes() < len(NODES):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the test cluster's nodes are not idle: {self.run('sinfo').stdout}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.kill(*[f"slurmd.{n}" for n in NODES], "slurmctld")
        left = self.processes()
        for proc in left:  # steps that outlived their daemons
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(left, timeout=10)


@contextlib.contextmanager
def cluster_for_tests(folder: Path):
    """A cluster for a test module: SLURM_CONF set in this process's environment while it lives
    (Slurm's commands, here and in the runs, find it there); at the end its jobs are cancelled, it
    is stopped and SLURM_CONF is as it was."""
    started = SlurmCluster.start(folder)
    before = os.environ.get("SLURM_CONF")
    os.environ.update(started.env)
    try:
        yield started
    finally:
        for line in started.run("squeue", "-h", "-o", "%i").stdout.split():
            started.run("scancel", line)
        started.stop()
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
