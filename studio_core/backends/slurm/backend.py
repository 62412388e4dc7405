"""The Slurm backend: the run executes on a Slurm cluster's nodes, as one batch job.

The studio writes a batch script into the run folder (slurm.sh) and submits it with
`sbatch`; the job id goes to slurm.json. The script's `srun` starts one supervisor per node
(`python -m studio_core.training.supervisor RUN_DIR`, as a local run has), which asks this
backend for its node (node.py): that node's torchrun with a c10d rendezvous on the first node,
its hardware samples, and, on the first node, the run's final status. Each node's supervisor
also records its own start and end (records.py: slurm-nodes/), so that a failed job says which
node failed first, not only the knock-on errors the other nodes saw. So a Slurm run needs nothing of the app: the
run folder (and this repository, and the compile cache) must be on storage every node sees.
The batch script is also what Export writes (export_script): the same text, for a run id
chosen at export. Submitted by plain `sbatch`, its job makes the run folder itself and records
its job id (job_start.py), so the studio follows that run like one it submitted.

Slurm owns the job's nodes: the studio leases no core of this machine for a Slurm run. The
run's state while it waits or runs is Slurm's (squeue); when the job is gone without a final
status (cancelled outside the studio, its time limit, a node failure), Slurm's own record of
how it ended (scontrol show job) becomes the run's final status (`ending`, which only reads),
written once into its events by `record_ending`, so the reason stays after Slurm has forgotten
the job. What a user chooses for the job (partition, time, ...) is options.SlurmOptions.

A sweep's runs go as one job array instead (array.py; the backend's `group`): each run keeps its own
slurm.sh, the array's task i runs run i's, and the run's job id is the task's, `<array id>_<i>`, which
every Slurm command here takes as it takes a plain job's (tools.py says how Slurm shows them). The
batch script and sbatch's options are batch.py's.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from studio_core.backends.base import Ending, RunBackend, StopError, SubmitError, has_final_status, recorded
from studio_core.backends.storage import unshared_warnings
from studio_core.backends.slurm import array
from studio_core.backends.slurm import tools as slurm
from studio_core.backends.slurm.batch import batch_script, refusals, sbatch_argv, without_records
from studio_core.backends.slurm.node import AUTO_RESUME_ENV, this_node
from studio_core.backends.slurm.options import KEY, SlurmOptions
from studio_core.backends.nodes import first_failed_node
from studio_core.backends.slurm.records import SCRIPT, job_of, node_records, record_job, submitted
from studio_core.rundir import events
from studio_core.rundir.folder import EVENTS

STARTING_GRACE_S = 30
CANCEL_WAIT_S = 60  # after scancel: Slurm's KillWait (30 s by default) and the steps' ending
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
    label = "Slurm"
    description = "a Slurm cluster"
    local_cores = False
    cluster = True
    max_nodes = None
    options_type = SlurmOptions
    group = "job array"  # a sweep's runs go as one (array.py)

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
        applied.append(("compile cache", str(compile_cache), "every node reads and writes it: on shared storage "
                        "each graph compiles once for all nodes and runs; on a node's own disk each node compiles "
                        "alone"))
        if layout.nodes > 1:
            warnings += unshared_warnings(run_dir, compile_cache)
        if self.options(layout).auto_resume:
            env[AUTO_RESUME_ENV] = "1"
            applied.append(("srun --auto-resume", 1, "HyperPod replaces a failed node and starts the step again; "
                            "the node supervisors then go on from the last checkpoint this job saved"))
        return applied, warnings

    def describe_launch(self, plan) -> list[str]:
        try:
            script = without_records(batch_script(plan))
        except ValueError as error:
            script = f"(none: {error})"
        return ["", f"Batch script (the run folder's {SCRIPT}):", script, "Submitted with:",
                "  " + shlex.join(sbatch_argv(plan.spec.layout))]

    def layout_problems(self, layout) -> list[str]:
        """The options' own check, and the cores: a job has its nodes to itself."""
        problems = self.options(layout).check()
        if layout.cores:
            problems.append("studio.cores: Slurm picks the nodes and the job has each node to itself; leave cores "
                            "empty for a Slurm run")
        return problems

    def export_script(self, plan) -> str:
        if plan.backend != self.name:
            raise ValueError(f"a Slurm batch script needs a plan for Slurm, not for {plan.backend!r}: plan it with "
                             "RunManager.export_plan")
        return batch_script(plan)

    def node(self, run_dir: Path, launch: dict):
        return this_node(run_dir)

    def check(self, layout, device: str) -> list[str]:
        """The layout's Slurm values (the rule spec.validate applies, applied here too: this
        backend writes nothing it would refuse, however it is called), then the cluster's answer
        to the layout: is Slurm there, is the partition, are there nodes enough."""
        problems = refusals(layout)
        if problems:
            return problems
        try:
            found = slurm.partitions()
        except slurm.SlurmError as error:
            return [f"Slurm: {error}"]
        options = self.options(layout)
        wanted = options.partition
        if wanted is None:
            partition = next((p for p in found.values() if p.default), None)
            if partition is None:
                return [f"{KEY}.partition: this cluster has no default partition; choose one of "
                        + ", ".join(found)]
        elif wanted not in found:
            return [f"{KEY}.partition: {wanted!r} is not a partition of this cluster; choose one of "
                    f"{', '.join(found) or '(none: sinfo lists no partition)'}"]
        else:
            partition = found[wanted]
        if layout.nodes > partition.nodes:
            return [f"studio.nodes: partition {partition.name} has {partition.nodes} node(s); ask for at most "
                    f"{partition.nodes}"]
        if options.auto_resume and not slurm.auto_resume_supported():
            return [f"{KEY}.auto_resume: this cluster's srun has no --auto-resume (a SageMaker HyperPod "
                    "option); leave it off, and resume from the studio"]
        return []

    def submit(self, run_dir: Path, launch, device: str) -> None:
        problems = refusals(launch.spec.layout)
        if problems:
            raise SubmitError("; ".join(problems))
        try:
            (run_dir / SCRIPT).write_text(batch_script(launch))
            job_id = slurm.submit(str(run_dir / SCRIPT), cwd=str(run_dir), extra=sbatch_argv(launch.spec.layout)[2:-1])
        except ValueError as error:
            raise SubmitError(str(error)) from error
        except slurm.SlurmError as error:
            raise SubmitError(str(error)) from error
        record_job(run_dir, job_id, time.time())  # unless the job, started at once, did first
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
            if not has_final_status(run_dir):
                events.append(run_dir / EVENTS, events.status("stopped", reason="stopped before it was submitted"))
            return
        if not self.alive(run_dir):
            self.record_ending(run_dir, 0.0)
            return
        try:
            slurm.cancel(job_id)
        except slurm.SlurmError as error:
            if self.alive(run_dir):
                raise StopError(f"Slurm did not cancel job {job_id} of run {run_dir.name}: {error}") from error
        deadline = time.monotonic() + max(grace_s, CANCEL_WAIT_S)
        while self.alive(run_dir):
            if time.monotonic() > deadline:
                raise StopError(f"Slurm still lists job {job_id} of run {run_dir.name} after scancel: see "
                                f"`squeue -j {job_id}`, and stop it again")
            time.sleep(0.5)
        if not has_final_status(run_dir):
            events.append(run_dir / EVENTS, events.status("stopped", reason=f"Stop now: Slurm cancelled job {job_id}"))

    def group_problems(self, plans: list) -> list[str]:
        return array.problems(plans)

    def submit_group(self, folder: Path, name: str, runs: list, parallel: int | None) -> str:
        """One job array (array.py), its script `<folder>/<name>.slurm.sh`; -> the array's job id."""
        return array.submit(Path(folder) / f"{name}{array.SUFFIX}", runs, parallel)

    def ending(self, run_dir: Path, created: float) -> Ending | None:
        return _ending(run_dir, created)[0]

    def record_ending(self, run_dir: Path, created: float) -> Ending | None:
        """The ending, written once into the run's events: Slurm forgets ended jobs after a while (MinJobAge)."""
        return recorded(run_dir, *_ending(run_dir, created))


def _ending(run_dir: Path, created: float) -> tuple[Ending | None, list[dict]]:
    """How a run with no final status ended (None while it may be starting), and the events that
    record it (none when the run's events already say, or Slurm does not answer). Reads only."""
    job_id = job_of(run_dir)
    if job_id is None:
        if time.time() - created < STARTING_GRACE_S:
            return None, []
        ending, fields = Ending("failed", "the run was never submitted to Slurm: see its log"), None
    else:
        try:
            fields = slurm.record(job_id)
        except slurm.SlurmError as error:
            return Ending("failed", f"Slurm job {job_id} is gone and Slurm does not answer ({error})"), []
        ending = slurm_ending(job_id, fields)
        if fields is None and slurm.array_task(job_id) and not node_records(run_dir, job_id):
            ending = Ending("stopped", f"Slurm job {job_id} is gone before it started, and Slurm keeps no record of "
                            "it: a waiting task of a job array cancelled on its own (scancel, outside the studio) "
                            "is dropped at once")
    run = events.fold(events.read(run_dir / EVENTS))
    if run.state in events.FINAL_STATES:
        return ending, []
    job_state = (fields or {}).get("JobState")
    down = _down_nodes(fields) if job_state in (*RUN_FAILED, "NODE_FAIL") else {}
    first = first_failed_node(node_records(run_dir, job_id)) if job_id and job_state in RUN_FAILED else None
    if down:  # a task that died with its node fails the job before Slurm calls it NODE_FAIL
        ending = Ending("failed", f"node {', '.join(down)} of Slurm job {job_id} went down while the run "
                        f"trained ({'; '.join(f'{kind}: {why}' for kind, why in down.values())}); resume from "
                        "the last checkpoint")
    elif first:  # the other nodes' errors (gloo's "Connection closed by peer") follow from this one
        after = f" (the last: {run.errors[-1].get('message', '')})" if run.errors else ""
        ending = Ending("failed", f"Slurm job {job_id}: {first}; the other nodes' errors follow from it{after}; "
                        "resume from the last checkpoint")
    elif job_state in RUN_FAILED and run.errors and run.errors[-1]["time"] > submitted(run_dir):
        return Ending("failed", run.errors[-1].get("message", "")), [events.status("failed")]  # its error says it
    return ending, [*([events.error(ending.reason)] if ending.state == "failed" else []),
                    events.status(ending.state, reason=ending.reason)]


def _down_nodes(fields: dict | None) -> dict[str, tuple[str, str]]:
    """The job's nodes Slurm has down now ({} when it cannot say)."""
    try:
        return slurm.failed_nodes((fields or {}).get("NodeList", ""))
    except slurm.SlurmError:
        return {}


def slurm_ending(job_id: str, fields: dict | None) -> Ending:
    """How a job that left no final status ended, from scontrol's record (None: forgotten)."""
    if not fields:
        return Ending("failed", f"Slurm job {job_id} ended without a final status from the run, and Slurm no "
                      "longer keeps its record (MinJobAge): see its log")
    state = fields.get("JobState", "")
    kind, text = ENDINGS.get(state, ("failed", "Slurm job {id} ended as " + state))
    return Ending(kind, text.format(id=job_id, **{k: fields.get(k, "?") for k in
                                                  ("TimeLimit", "NodeList", "Reason", "ExitCode")}))
