"""The Slurm backend: the run executes on a Slurm cluster's nodes, as one batch job.

The studio writes a batch script into the run folder (slurm.sh) and submits it with
`sbatch`; the job id goes to slurm.json. The script's `srun` starts one supervisor per node
(`python -m studio_core.supervisor RUN_DIR`, as a local run has), which runs that node's
torchrun with a c10d rendezvous on the first node, samples that node's hardware, and, on
the first node, writes the run's final status. So a Slurm run needs nothing of the app: the
run folder (and this repository, and the compile cache) must be on storage every node sees.

Slurm owns the job's nodes: the studio leases no core of this machine for a Slurm run. The
run's state while it waits or runs is Slurm's (squeue); when the job is gone without a final
status (cancelled outside the studio, its time limit, a node failure), Slurm's own record of
how it ended (scontrol show job) becomes the run's final status, written once into its events,
so the reason stays after Slurm has forgotten the job.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import psutil

from studio_core import slurm
from studio_core.backends.base import Ending, RunBackend, SubmitError
from studio_core.children import REPO_ROOT
from studio_core.runs import events
from studio_core.runs.folder import EVENTS, LOG, read_json, write_json

SCRIPT = "slurm.sh"
JOB = "slurm.json"  # {"job_id": the current attempt's, "job_ids": every attempt's, "submitted": time}
STARTING_GRACE_S = 30
CANCEL_WAIT_S = 60  # after scancel: Slurm's KillWait (30 s by default) and the steps' ending
SHARED_FILESYSTEMS = ("nfs", "nfs4", "lustre", "beegfs", "gpfs", "cifs", "smb3", "ceph", "glusterfs", "fuse.s3fs",
                      "fuse.mount-s3", "efs", "wekafs")
# How Slurm's end states (scontrol's JobState) read as the studio's.
ENDINGS = {
    "CANCELLED": ("stopped", "Slurm job {id} was cancelled outside the studio (scancel)"),
    "TIMEOUT": ("failed", "Slurm ended job {id} at its time limit ({TimeLimit}); give it more time (Time limit, "
                "--time) or save checkpoints (save_steps) and resume"),
    "NODE_FAIL": ("failed", "a node of Slurm job {id} failed ({NodeList}: {Reason}); resume from the last checkpoint"),
    "PREEMPTED": ("stopped", "Slurm preempted job {id} for another job; resume from the last checkpoint"),
    "BOOT_FAIL": ("failed", "a node of Slurm job {id} failed to boot ({Reason})"),
    "OUT_OF_MEMORY": ("failed", "Slurm job {id} ran out of memory on {NodeList}"),
    "DEADLINE": ("failed", "Slurm ended job {id} at its deadline"),
    "FAILED": ("failed", "Slurm job {id} failed (exit code {ExitCode}) without a final status from the run: see its "
               "log"),
    "COMPLETED": ("failed", "Slurm job {id} completed, but its first node wrote no final status: see its log"),
}
RUN_FAILED = ("FAILED", "COMPLETED", None)  # Slurm states that say nothing beyond the run's own error


class SlurmBackend(RunBackend):
    name = "slurm"
    description = "a Slurm cluster"
    local_cores = False

    def launch_argv(self, layout, module: str, run_dir: str) -> list[str]:
        # HEAD_ADDR, RDZV_PORT and SLURM_JOB_ID are set on each node, where the supervisor expands them
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={layout.nodes}",
                f"--nproc-per-node={layout.nproc}", "--rdzv-backend=c10d", "--rdzv-id=$SLURM_JOB_ID",
                "--rdzv-endpoint=$HEAD_ADDR:$RDZV_PORT", "-m", module, str(run_dir)]

    def planned(self, spec, hardware, env: dict, run_dir, compile_cache) -> tuple[list, list]:
        layout, applied, warnings = spec.layout, [], []
        applied.append(("sbatch --nodes", layout.nodes, f"{layout.nodes} node(s), each running {layout.nproc} "
                        f"process(es) planned for {hardware.describe()} (Plan for: the compute nodes' type)"))
        applied.append(("sbatch --ntasks-per-node", 1, "one supervisor per node starts that node's torchrun"))
        applied.append(("sbatch --exclusive", True, "the run has its nodes to itself: every core and the "
                        "network, and no other job's processes on its devices"))
        applied.append(("sbatch --no-requeue", True, "after a node failure Slurm would start the job again from "
                        "step 0 into the same run folder; the run ends failed instead, and Resume goes on from "
                        "its last checkpoint"))
        if hardware.backend == "neuron":
            for key, value, reason in (
                    ("FI_PROVIDER", "efa", "libfabric talks to the nodes' EFA adapters: collectives between "
                     "nodes go over EFA"),
                    ("FI_EFA_USE_DEVICE_RDMA", "1", "the Neuron devices read and write across nodes directly "
                     "(RDMA), without a copy through host memory"),
                    ("FI_EFA_FORK_SAFE", "1", "data loader workers fork; without it, forked processes can break "
                     "registered EFA memory (needed on Amazon Linux 2)")):
                env[key] = value
                applied.append((key, value, reason))
        applied.append(("compile cache", str(compile_cache), "every node reads and writes it: on shared storage "
                        "each graph compiles once for all nodes and runs; on a node's own disk each node compiles "
                        "alone"))
        if layout.nodes > 1:
            for what, path, setting in (("runs folder", Path(run_dir).parent, "--runs-dir or STUDIO_RUNS_DIR"),
                                        ("compile cache", Path(compile_cache), "STUDIO_COMPILE_CACHE")):
                if not shared_storage(path):
                    warnings.append(f"the {what} {path} is on this machine's own disk ({filesystem(path)}): "
                                    f"the other nodes cannot see it. Put it on storage every node mounts "
                                    f"(e.g. FSx for Lustre, NFS) with {setting}")
        if layout.slurm.get("auto_resume"):
            env[AUTO_RESUME_ENV] = "1"
            applied.append(("srun --auto-resume", 1, "HyperPod replaces a failed node and starts the step again; "
                            "the node supervisors then go on from the last checkpoint this job saved"))
        return applied, warnings

    def describe_launch(self, plan) -> list[str]:
        return ["", f"Batch script (the run folder's {SCRIPT}):", batch_script(plan), "Submitted with:",
                "  " + shlex.join(sbatch_argv(plan.spec.layout))]

    def check(self, layout) -> list[str]:
        """The cluster's answer to the layout: is Slurm there, is the partition, are there nodes enough."""
        try:
            found = slurm.partitions()
        except slurm.SlurmError as error:
            return [f"Slurm: {error}"]
        wanted = layout.slurm.get("partition")
        if wanted is None:
            partition = next((p for p in found.values() if p.default), None)
            if partition is None:
                return ["studio.slurm.partition: this cluster has no default partition; choose one of "
                        + ", ".join(found)]
        elif wanted not in found:
            return [f"studio.slurm.partition: {wanted!r} is not a partition of this cluster; choose one of "
                    f"{', '.join(found) or '(none: sinfo lists no partition)'}"]
        else:
            partition = found[wanted]
        if layout.nodes > partition.nodes:
            return [f"studio.nodes: partition {partition.name} has {partition.nodes} node(s); ask for at most "
                    f"{partition.nodes}"]
        if layout.slurm.get("auto_resume") and not slurm.auto_resume_supported():
            return ["studio.slurm.auto_resume: this cluster's srun has no --auto-resume (a SageMaker HyperPod "
                    "option); leave it off, and resume from the studio"]
        return []

    def submit(self, run_dir: Path, launch, backend: str) -> None:
        (run_dir / SCRIPT).write_text(batch_script(launch))
        try:
            job_id = slurm.submit(str(run_dir / SCRIPT), cwd=str(run_dir),
                                  extra=launch.spec.layout.slurm.get("sbatch_args", []))
        except slurm.SlurmError as error:
            raise SubmitError(str(error)) from error
        before = read_json(run_dir / JOB).get("job_ids", [])
        write_json(run_dir / JOB, {"job_id": job_id, "job_ids": [*before, job_id], "submitted": time.time()})
        events.append(run_dir / EVENTS, events.log(f"submitted to Slurm as job {job_id}"))

    def alive(self, run_dir: Path) -> bool:
        job_id = job_of(run_dir)
        if job_id is None:
            return False
        try:
            job = slurm.queued(job_id)
        except slurm.SlurmError:
            return True  # the controller does not answer: the job may well go on; say nothing ended
        return job is not None and job.active

    def where(self, run_dir: Path, live: bool) -> str | None:
        job_id = job_of(run_dir)
        if job_id is None or not live:
            return job_id and f"Slurm job {job_id}"
        try:
            job = slurm.queued(job_id)
        except slurm.SlurmError as error:
            return f"Slurm job {job_id}: Slurm does not answer ({error})"
        return job.describe() if job else f"Slurm job {job_id}"

    def stop(self, run_dir: Path, grace_s: float) -> None:
        """scancel the job (Slurm sends SIGTERM to every node's processes, then SIGKILL), wait until
        Slurm lists it no more, and say "stopped" when the run did not. A job that had already
        ended gets its ending recorded instead."""
        job_id = job_of(run_dir)
        if job_id is None:
            if not _final(run_dir):
                events.append(run_dir / EVENTS, events.status("stopped", reason="stopped before it was submitted"))
            return
        if not self.alive(run_dir):
            self.ending(run_dir, 0.0)
            return
        try:
            slurm.cancel(job_id)
        except slurm.SlurmError:
            if self.alive(run_dir):
                raise
        deadline = time.monotonic() + max(grace_s, CANCEL_WAIT_S)
        while self.alive(run_dir):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm still lists job {job_id} of run {run_dir.name} after scancel")
            time.sleep(0.5)
        if not _final(run_dir):
            events.append(run_dir / EVENTS, events.status("stopped", reason=f"Stop now: Slurm cancelled job {job_id}"))

    def ending(self, run_dir: Path, created: float) -> Ending | None:
        job_id = job_of(run_dir)
        if job_id is None:
            if time.time() - created < STARTING_GRACE_S:
                return None
            ending, fields = Ending("failed", "the run was never submitted to Slurm: see its log"), None
        else:
            try:
                fields = slurm.record(job_id)
            except slurm.SlurmError as error:
                return Ending("failed", f"Slurm job {job_id} is gone and Slurm does not answer ({error})")
            ending = slurm_ending(job_id, fields)
        run = events.fold(events.read(run_dir / EVENTS))
        if run.state in events.FINAL_STATES:
            return ending
        job_state = (fields or {}).get("JobState")
        down = _down_nodes(fields) if job_state in (*RUN_FAILED, "NODE_FAIL") else {}
        if down:  # a task that died with its node fails the job before Slurm calls it NODE_FAIL
            ending = Ending("failed", f"node {', '.join(down)} of Slurm job {job_id} went down while the run "
                            f"trained ({'; '.join(f'{kind}: {why}' for kind, why in down.values())}); resume from "
                            "the last checkpoint")
        elif job_state in RUN_FAILED and run.errors and run.errors[-1]["time"] > _submitted(run_dir):
            events.append(run_dir / EVENTS, events.status("failed"))  # the run's own error says it all
            return Ending("failed", run.errors[-1].get("message", ""))
        # written once: Slurm forgets ended jobs after a while (MinJobAge)
        if ending.state == "failed":
            events.append(run_dir / EVENTS, events.error(ending.reason))
        events.append(run_dir / EVENTS, events.status(ending.state, reason=ending.reason))
        return ending


def _down_nodes(fields: dict | None) -> dict[str, tuple[str, str]]:
    """The job's nodes Slurm has down now ({} when it cannot say)."""
    try:
        return slurm.failed_nodes((fields or {}).get("NodeList", ""))
    except slurm.SlurmError:
        return {}


AUTO_RESUME_ENV = "STUDIO_AUTO_RESUME"  # "1": the job's srun restarts its step after a node failure (HyperPod)


def slurm_ending(job_id: str, fields: dict | None) -> Ending:
    """How a job that left no final status ended, from scontrol's record (None: forgotten)."""
    if not fields:
        return Ending("failed", f"Slurm job {job_id} ended without a final status from the run, and Slurm no "
                      "longer keeps its record (MinJobAge): see its log")
    state = fields.get("JobState", "")
    kind, text = ENDINGS.get(state, ("failed", "Slurm job {id} ended as " + state))
    return Ending(kind, text.format(id=job_id, **{k: fields.get(k, "?") for k in
                                                  ("TimeLimit", "NodeList", "Reason", "ExitCode")}))


def _submitted(run_dir: Path) -> float:
    return float(read_json(run_dir / JOB).get("submitted", 0))


def job_of(run_dir: Path) -> str | None:
    """The Slurm job id of the run's current attempt, or None before it is submitted."""
    job_id = read_json(run_dir / JOB).get("job_id")
    return str(job_id) if job_id else None


def _final(run_dir: Path) -> bool:
    return events.fold(events.read(run_dir / EVENTS)).state in events.FINAL_STATES


def sbatch_argv(layout) -> list[str]:
    return ["sbatch", "--parsable", *layout.slurm.get("sbatch_args", []), SCRIPT]


def batch_script(plan) -> str:
    """The batch script of a planned Slurm run: one node supervisor per node, on the run folder."""
    layout, run_dir = plan.spec.layout, plan.argv[-1]
    options = layout.slurm
    sbatch = [f"--job-name={plan.spec.display_name}", f"--nodes={layout.nodes}", "--ntasks-per-node=1",
              "--exclusive", "--no-requeue",
              *[f"--{key}={options[key]}" for key in ("partition", "time", "account") if key in options],
              f"--output={run_dir}/{LOG}", "--open-mode=append", f"--chdir={run_dir}"]
    env = dict(plan.env)
    python_path = env.pop("PYTHONPATH")
    srun = ["srun", "--label", "--kill-on-bad-exit=1", *(["--auto-resume=1"] if options.get("auto_resume") else []),
            plan.argv[0], "-m", "studio_core.supervisor", run_dir]
    return "\n".join([
        "#!/usr/bin/env bash",
        *[f"#SBATCH {option}" for option in sbatch],
        f"# {plan.spec.display_name}: {layout.nodes} node(s) x {layout.nproc} process(es), written by the studio.",
        "# Every node must see the run folder, the compile cache and the studio's repository",
        f"# ({REPO_ROOT}): shared storage, e.g. FSx for Lustre or NFS.",
        "set -euo pipefail",
        f"export PYTHONPATH={shlex.quote(python_path)}${{PYTHONPATH:+:$PYTHONPATH}}",
        *[f"export {key}={shlex.quote(value)}" for key, value in env.items()],
        "# one supervisor per node: it runs the node's torchrun (rendezvous on the first node), samples",
        "# the node's hardware, and on the first node writes the run's final status",
        shlex.join(srun),
        "",
    ])


def filesystem(path: Path) -> str:
    """The type of the filesystem `path` (or its nearest existing parent) is on."""
    path = Path(path).expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    best = max((p for p in psutil.disk_partitions(all=True) if str(path).startswith(p.mountpoint.rstrip("/") + "/")
                or str(path) == p.mountpoint), key=lambda p: len(p.mountpoint), default=None)
    return best.fstype if best else "unknown"


def shared_storage(path: Path) -> bool:
    """Is `path` on a network filesystem the cluster's nodes can all mount?"""
    return filesystem(path) in SHARED_FILESYSTEMS or filesystem(path).startswith("fuse.")
