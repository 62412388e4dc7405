"""The Slurm backend: the run executes on a Slurm cluster's nodes, as one batch job.

The studio writes a batch script into the run folder (slurm.sh) and submits it with
`sbatch`; the job id goes to slurm.json. The script's `srun` starts one supervisor per node
(`python -m studio_core.training.supervisor RUN_DIR`, as a local run has), which runs that node's
torchrun with a c10d rendezvous on the first node, samples that node's hardware, and, on
the first node, writes the run's final status. Each node's supervisor also records its own
start and end (slurm-nodes/), so that a failed job says which node failed first, not only the
knock-on errors the other nodes saw. So a Slurm run needs nothing of the app: the
run folder (and this repository, and the compile cache) must be on storage every node sees.
The batch script is also what Export writes (scripts.slurm_script): the same text, for a run
id chosen at export. Submitted by plain `sbatch`, its job makes the run folder itself and
records its job id (scripts.job_start), so the studio follows that run like one it submitted.

Slurm owns the job's nodes: the studio leases no core of this machine for a Slurm run. The
run's state while it waits or runs is Slurm's (squeue); when the job is gone without a final
status (cancelled outside the studio, its time limit, a node failure), Slurm's own record of
how it ended (scontrol show job) becomes the run's final status, written once into its events,
so the reason stays after Slurm has forgotten the job.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import sys
import time
import unicodedata
from pathlib import Path

import psutil

from studio_core.backends.slurm import tools as slurm
from studio_core.backends.base import Ending, RunBackend, SubmitError
from studio_core.machine.children import REPO_ROOT
from studio_core.rundir import events
from studio_core.rundir.folder import EVENTS, LOG, launch_record, read_json, write_json

SCRIPT = "slurm.sh"
NODES = "slurm-nodes"  # a record per job and node (record_node): node, host, job_id, started, ended, exit_code, stopped
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
        try:
            script = without_records(batch_script(plan))
        except ValueError as error:
            script = f"(none: {error})"
        return ["", f"Batch script (the run folder's {SCRIPT}):", script, "Submitted with:",
                "  " + shlex.join(sbatch_argv(plan.spec.layout))]

    def check(self, layout) -> list[str]:
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
        first = first_failed_node(node_records(run_dir, job_id)) if job_id and job_state in RUN_FAILED else None
        if down:  # a task that died with its node fails the job before Slurm calls it NODE_FAIL
            ending = Ending("failed", f"node {', '.join(down)} of Slurm job {job_id} went down while the run "
                            f"trained ({'; '.join(f'{kind}: {why}' for kind, why in down.values())}); resume from "
                            "the last checkpoint")
        elif first:  # the other nodes' errors (gloo's "Connection closed by peer") follow from this one
            after = f" (the last: {run.errors[-1].get('message', '')})" if run.errors else ""
            ending = Ending("failed", f"Slurm job {job_id}: {first}; the other nodes' errors follow from it{after}; "
                            "resume from the last checkpoint")
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


def refusals(layout) -> list[str]:
    """What is wrong with the layout's Slurm values: slurm.check_options, the one rule for them."""
    if not isinstance(layout.slurm, dict):
        return ["studio.slurm: must be a mapping of partition, time, account, sbatch_args, auto_resume"]
    return [p for p in [slurm.check_nodes(layout.nodes)] if p] + slurm.check_options(layout.slurm)


def sbatch_argv(layout) -> list[str]:
    """The sbatch command: the user's options as sbatch gets them (--name=value; a refused one is left out)."""
    extra = layout.slurm.get("sbatch_args", []) if isinstance(layout.slurm, dict) else []
    return ["sbatch", "--parsable", *slurm.sbatch_words(extra if isinstance(extra, list) else [])[0], SCRIPT]


def _one_line(text: str) -> str:
    """Text for a comment line of the script: a control character (a line break) shown as '?'."""
    return "".join("?" if unicodedata.category(c).startswith("C") else c for c in str(text))


# The batch job's first step (scripts.job_start), as the script runs it: the run folder made on a first
# start by plain sbatch, the job recorded in it; the plan's records come on stdin (PAYLOAD_END ends them).
JOB_START = "import sys; from studio_core.training.scripts import job_start; sys.exit(job_start(*sys.argv[1:]))"
PAYLOAD_END = "STUDIO_RUN_RECORDS"


def export_lines(env: dict) -> list[str]:
    """The plan's environment as the shell exports it, every value quoted; PYTHONPATH prepended to
    the one the script finds (Plan.env's rule). ValueError on a name the shell cannot export."""
    env = dict(env)
    python_path = env.pop("PYTHONPATH", None)
    bad_keys = [key for key in env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key)]
    if bad_keys:
        raise ValueError(f"environment variable names the shell cannot export: {bad_keys}")
    return ([f"export PYTHONPATH={shlex.quote(python_path)}${{PYTHONPATH:+:$PYTHONPATH}}"] if python_path else []) + [
        f"export {key}={shlex.quote(str(value))}" for key, value in env.items()]


def mesh_note(layout) -> list[str]:
    """A comment on how a TP/FSDP layout spans several machines, for the scripts' headers."""
    if layout.tp_size == 1 and layout.fsdp_size == 1:
        return []
    return [f"# Each node runs one TP {layout.tp_size} x FSDP {layout.fsdp_size} mesh; the worker replicates it "
            "across nodes (DistributedConfig dp_replicate_size = the number of nodes: HSDP)."]


def batch_script(plan) -> str:
    """The batch script of a planned Slurm run: what the studio submits, and what Export writes
    (the same text: the run id is chosen before either). Its job makes the run folder on a first
    start by plain `sbatch` (spec.yaml, launch.json and the first events, carried in the script),
    records its job id in slurm.json, then starts one node supervisor per node with srun.
    Every word is quoted for the shell (sbatch reads #SBATCH lines with the same quotes); a run
    folder whose path holds a line break is refused (ValueError): no quoting keeps it in a
    #SBATCH line or a comment, which run to the line's end.
    No #SBATCH --output or --chdir into the run folder: Slurm opens them before the script runs,
    and fails the job when the folder is not there yet (JobLaunchFailure). The job's own lines
    before the folder exists go to Slurm's default slurm-<job id>.out where sbatch ran."""
    layout, run_dir = plan.spec.layout, plan.argv[-1]
    if _one_line(run_dir) != str(run_dir):
        raise ValueError(f"the run folder {str(run_dir)!r} holds a control character (a line break?): give the "
                         "runs folder a path without one")
    options = layout.slurm if isinstance(layout.slurm, dict) else {}
    extra = options.get("sbatch_args", [])
    sbatch = [f"--job-name={slurm.job_name(plan.spec.display_name)}", f"--nodes={layout.nodes}", "--ntasks-per-node=1",
              "--exclusive", "--no-requeue",
              *[f"--{key}={options[key]}" for key in ("partition", "time", "account") if key in options],
              *slurm.sbatch_words(extra if isinstance(extra, list) else [])[0]]  # plain sbatch gets them too
    srun = ["srun", "--label", "--kill-on-bad-exit=1", *(["--auto-resume=1"] if options.get("auto_resume") else []),
            plan.argv[0], "-m", "studio_core.training.supervisor", run_dir]
    records = {"spec.yaml": plan.spec.to_yaml().splitlines(), "launch.json": launch_record(plan)}
    return "\n".join([
        "#!/usr/bin/env bash",
        *[f"#SBATCH {shlex.quote(_one_line(option))}" for option in sbatch],
        f"# {_one_line(plan.spec.display_name)}: {layout.nodes} node(s) x {layout.nproc} process(es), written by the "
        f"studio for run {_one_line(Path(run_dir).name)}.",
        "# Submit it as it is (sbatch THIS_FILE): the studio submits this same script. Its job makes the run",
        "# folder on the run's first start and records itself there, so the studio lists, follows and stops",
        "# the run; the output goes to the folder's train.log.",
        "# Every node must see the run folder, the compile cache and the studio's repository",
        f"# ({_one_line(REPO_ROOT)}): shared storage, e.g. FSx for Lustre or NFS.",
        *mesh_note(layout),
        "set -euo pipefail",
        *export_lines(plan.env),
        "# the run folder, made on the run's first start; this job recorded in it (slurm.json)",
        f"{shlex.quote(plan.argv[0])} -c {shlex.quote(JOB_START)} {shlex.quote(run_dir)} \"$0\" <<'{PAYLOAD_END}'",
        _json_text(records),  # JSON: no line of it can be the end marker
        PAYLOAD_END,
        f"cd {shlex.quote(run_dir)}",
        f"exec >>{shlex.quote(f'{run_dir}/{LOG}')} 2>&1",
        "# one supervisor per node: it runs the node's torchrun (rendezvous on the first node), samples",
        "# the node's hardware, and on the first node writes the run's final status",
        shlex.join(srun),
        "",
    ])


def without_records(script: str) -> str:
    """The batch script as a plan shows it: the run's records (spec and launch.json, a hundred
    lines of JSON the job's first step reads) as one line that says what is there."""
    lines = script.split("\n")
    if PAYLOAD_END not in lines:
        return script
    end = lines.index(PAYLOAD_END)
    start = next(i for i in range(end - 1, -1, -1) if lines[i].endswith(f"<<'{PAYLOAD_END}'"))
    return "\n".join([*lines[:start + 1], f"(the run's spec.yaml and launch.json as JSON: {end - start - 1} lines)",
                      *lines[end:]])


def _json_text(value, depth: int = 0) -> str:
    """JSON for people: the outer levels one entry per line (the spec's lines, launch.json's keys, the
    environment, each applied setting), what is inside them on one line."""
    inner = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else None
    wide = isinstance(value, dict) or any(isinstance(item, (dict, list)) or len(str(item)) > 40 for item in inner or [])
    if not inner or depth > 2 or (depth == 2 and not wide):
        return json.dumps(value, default=str)
    lines = [f"{json.dumps(key)}: {_json_text(item, depth + 1)}" for key, item in value.items()] if isinstance(
        value, dict) else [_json_text(item, depth + 1) for item in value]
    opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
    return opening + "\n" + ",\n".join(" " * (depth + 1) + line for line in lines) + "\n" + " " * depth + closing


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
