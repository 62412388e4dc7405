"""The Ray backend: the run executes on a Ray cluster's nodes, as one Ray job.

The studio submits the job through Ray's Jobs API (the head's dashboard address, `--ray
http://HEAD:8265`); the job id goes to ray.json. The job's driver (job.py) asks Ray for the
run's nodes as a placement group and starts one supervisor per node, which asks this backend for
its node (node.py): that node's torchrun with a c10d rendezvous on the first node, and, on the
first node, the run's final status. So a Ray run needs nothing of the app: the run folder, this
repository and the compile cache must be on storage every node sees (as on Slurm).

Ray owns the job's nodes: the studio leases no core of this machine for a Ray run; on Neuron and
CUDA a node's ranks get the cores Ray assigned that node (job.py). While the run
waits or runs, its place is Ray's job status (PENDING, RUNNING, ...); when the job is over without
a final status (stopped outside the studio with `ray job stop`, its driver or a node failed),
Ray's own word on the job becomes the run's final status (`ending`, which only reads), written
once into its events by `record_ending`.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
import urllib.request
from functools import lru_cache
from pathlib import Path

from studio_core.backends.base import Ending, RunBackend, StopError, SubmitError, has_final_status, recorded
from studio_core.backends.nodes import first_failed_node
from studio_core.backends.ray.node import RESOURCES, this_node
from studio_core.backends.ray.options import KEY, RayOptions
from studio_core.backends.ray.records import job_of, node_records, record_job, submitted
from studio_core.backends.storage import unshared_warnings
from studio_core.rundir import events
from studio_core.rundir.folder import EVENTS

STARTING_GRACE_S = 30
STOP_WAIT_S = 60  # after Ray's stop: the supervisors end their torchrun (their own grace) and record it
# How long Ray waits after its SIGTERM to a stopped job's driver before it SIGKILLs it (Ray 2.60
# source, python/ray/dashboard/modules/job/job_supervisor.py: RAY_JOB_STOP_WAIT_TIME_S, default
# 3 s, read from the job supervisor's environment, which has the job's runtime_env variables).
# The driver ending kills the node actors and so their supervisors: 3 s cut off a supervisor still
# ending its ranks (its grace is 10 s, then SIGKILL) before it recorded its end, on a busy node,
# and the stop then waited for a record that never came.
JOB_STOP_WAIT_S = 30
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class RayError(RuntimeError):
    """Ray's Jobs API could not be reached, or refused."""


@lru_cache(maxsize=8)
def client(address: str):
    """Ray's Jobs API client for the cluster at `address` (RayError when it does not answer), made
    once per address: making one asks the cluster, and the Runs tab asks about a job often."""
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise RayError(f"no Ray cluster answers at {address}: {error}") from error


def job_info(address: str, job_id: str):
    """Ray's record of the job (its JobDetails: status, message), or None when the cluster answers
    but does not know the job: its head was restarted, and a Ray head keeps its jobs in its own
    memory (unless the cluster was set up with GCS fault tolerance, an external Redis). RayError
    when the cluster does not answer."""
    try:
        return client(address).get_job_info(job_id)
    except RayError:
        raise
    except RuntimeError as error:  # the Jobs API's answer other than 200 (ray.dashboard's _raise_error)
        if "status code 404" in str(error):
            return None
        raise RayError(f"Ray at {address} refused to say how job {job_id} is: {error}") from error
    except OSError as error:  # requests' ConnectionError and timeouts are OSErrors
        raise RayError(f"no Ray cluster answers at {address}: {error}") from error


def forgotten(job_id: str, address: str) -> str:
    return (f"Ray job {job_id}: the Ray cluster at {address} no longer knows it: its head was restarted (a head "
            "keeps its jobs in memory), which ended the job on every node; resume from the last checkpoint")


# what to do when something other than a Ray head's dashboard answers at the address given
NOT_RAY = ("give the address of the Ray head's dashboard (http://HEAD:8265), which must run with the full "
           "dashboard (pip install 'ray[default]' on the head)")


def cluster_version(address: str) -> str:
    """The Ray version the cluster at `address` runs (its dashboard's /api/version: a JSON object
    with `ray_version`, Ray 2.60's job_head.py); RayError when nothing answers, or not as Ray does."""
    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/api/version", timeout=10) as answer:
            body = answer.read()
    except (OSError, ValueError) as error:  # ValueError: an address urllib cannot use
        raise RayError(f"no Ray cluster answers at {address}: {error}") from error
    try:
        said = json.loads(body)
    except ValueError:  # not JSON (nor UTF-8): shown as the text it is
        said = body.decode(errors="replace")
    version = said.get("ray_version") if isinstance(said, dict) else None
    if not isinstance(version, str) or not version:
        raise RayError(f"the server at {address} is not a Ray dashboard: its /api/version gave {_short(said)}, "
                       f"where a Ray dashboard's names its ray_version: {NOT_RAY}")
    return version


def node_offers(address: str, resource: str) -> list[float]:
    """How much of `resource` each live node of the cluster at `address` has in all, most first
    (Ray's state API, /api/v0/nodes); RayError when its dashboard does not answer that API, or not
    as Ray does."""
    from ray.util.state import list_nodes
    from ray.util.state.exception import RayStateApiException

    try:
        alive = [n for n in list_nodes(address=address, detail=True) if n.state == "ALIVE"]
        return sorted((float((n.resources_total or {}).get(resource, 0)) for n in alive), reverse=True)
    except RayStateApiException as error:
        raise RayError(f"the server at {address} answers /api/version as a Ray dashboard does, but not Ray's "
                       f"state API ({_state_api_said(error)}): {NOT_RAY}") from None
    except (KeyError, TypeError, AttributeError, ValueError) as error:  # an answer not shaped as Ray's
        raise RayError(f"the server at {address} answers Ray's state API (/api/v0/nodes) otherwise than Ray does "
                       f"({type(error).__name__}: {error}): {NOT_RAY}") from None


def _state_api_said(error: Exception) -> str:
    """What Ray's state client said of the answer it could not use, short: its HTTP status when it names one."""
    status = re.search(r"status=(\d+)", str(error))
    return f"/api/v0/nodes answered HTTP {status[1]}" if status else str(error).splitlines()[0][:200]


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


NO_AGENT = "No available agent to submit job"  # Ray's 500 while the head's job agent starts: it says try again
AGENT_WAIT_S = 30


class RayBackend(RunBackend):
    name = "ray"
    label = "Ray"
    description = "a Ray cluster"
    local_cores = False
    cluster = True
    max_nodes = None
    options_type = RayOptions

    def launch_argv(self, layout, module: str, run_dir: str) -> list[str]:
        # HEAD_ADDR, RDZV_PORT, STUDIO_RAY_JOB and STUDIO_RAY_HOST are set by the job's driver on each node.
        # The first node hosts the rendezvous store, said outright (is_host): torchrun's own guess
        # compares the address with this machine's name, and misses an address of a second network
        # interface (and two nodes on one machine would both claim it).
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={layout.nodes}",
                f"--nproc-per-node={layout.nproc}", "--rdzv-backend=c10d", "--rdzv-id=$STUDIO_RAY_JOB",
                "--rdzv-endpoint=$HEAD_ADDR:$RDZV_PORT", "--rdzv-conf=is_host=$STUDIO_RAY_HOST", "-m", module,
                str(run_dir)]

    def planned(self, spec, hardware, env: dict, run_dir, compile_cache) -> tuple[list, list]:
        layout = spec.layout
        resource = RESOURCES[hardware.backend]
        applied = [("Ray job", self.options(layout).address, "submitted through the Jobs API of the cluster's head"),
                   ("Ray placement group", f"{layout.nodes} x {{{resource}: {layout.nproc}}}, STRICT_SPREAD",
                    f"one bundle per node ({layout.nproc} process(es) on {hardware.describe()}); Ray reserves "
                    "them for the run, whose nodes then run one supervisor and torchrun each"
                    + (f"; each node's ranks get the {resource} ids Ray assigned that node" if resource != "CPU"
                       else ""))]
        return applied, unshared_warnings(run_dir, compile_cache) if layout.nodes > 1 else []

    def describe_launch(self, plan) -> list[str]:
        return ["", f"Submitted to Ray at {self.options(plan.spec.layout).address} as a job whose entrypoint is:",
                "  " + shlex.join(entrypoint(plan.argv[0], plan.argv[-1], "JOB_ID"))]

    def layout_problems(self, layout) -> list[str]:
        options = self.options(layout)
        problems = options.check()
        if options.address is None:
            problems.append(f"{KEY}.address: give the Ray cluster's dashboard address (--ray http://HEAD:8265)")
        if layout.cores:
            problems.append("studio.cores: Ray picks the nodes and reserves their cores; leave cores empty for a "
                            "Ray run")
        return problems

    def check(self, layout, device: str) -> list[str]:
        """The cluster's answer: is it there, is it this Ray version, has it nodes enough, each
        with the cores of `device` one node of the run asks for. (What the nodes have in all, not
        what is free now: a job waiting for busy cores is PENDING, and says so.)"""
        problems = self.layout_problems(layout)
        if problems:
            return problems
        address = self.options(layout).address
        try:
            theirs = cluster_version(address)
        except RayError as error:
            return [f"{KEY}.address: {error}"]
        import ray

        if theirs != ray.__version__:
            return [f"{KEY}.address: the cluster runs Ray {theirs}, this studio Ray {ray.__version__}: install "
                    f"ray=={theirs} here (a job's driver must match its cluster)"]
        resource = RESOURCES[device]
        try:
            offers = node_offers(address, resource)
        except RayError as error:
            return [f"{KEY}.address: {error}"]
        if layout.nodes > len(offers):
            return [f"studio.nodes: the Ray cluster at {address} has {len(offers)} node(s); ask for at most "
                    f"{len(offers)}"]
        if sum(offer >= layout.nproc for offer in offers) < layout.nodes:
            most = int(offers[layout.nodes - 1])
            change = (f"ask for at most {most} process(es) per node{' or fewer nodes' if layout.nodes > 1 else ''}"
                      if most else f"run it on a cluster whose nodes have {resource}")
            return [f"studio.nproc: the run asks Ray for {layout.nproc} {resource} on each of {layout.nodes} "
                    f"node(s), and the cluster at {address} has fewer nodes with that many (its nodes have "
                    f"{', '.join(f'{offer:g}' for offer in offers)} {resource}): {change}"]
        return []

    def submit(self, run_dir: Path, launch, device: str) -> None:
        address = self.options(launch.spec.layout).address
        problems = self.layout_problems(launch.spec.layout)
        if problems:
            raise SubmitError("; ".join(problems))
        job_id = f"studio-{run_dir.name}-{int(time.time())}"  # an attempt's: a resume submits a new job
        deadline = time.monotonic() + AGENT_WAIT_S
        while True:
            try:
                client(address).submit_job(entrypoint=shlex.join(entrypoint(launch.argv[0], str(run_dir), job_id)),
                                           submission_id=job_id, runtime_env={"env_vars": {
                                               **launch.env, "RAY_JOB_STOP_WAIT_TIME_S": str(JOB_STOP_WAIT_S)}},
                                           metadata={"studio_run": run_dir.name})
                break
            except (RayError, RuntimeError) as error:
                # a head just started (or restarted) answers this until its job agent has registered
                if NO_AGENT in str(error) and time.monotonic() < deadline:
                    time.sleep(1)
                    continue
                raise SubmitError(str(error)) from error
        record_job(run_dir, job_id, address, time.time())
        events.append(run_dir / EVENTS, events.log(f"submitted to Ray as job {job_id} (dashboard {address})"))

    def node(self, run_dir: Path, launch: dict):
        return this_node(run_dir)

    def alive(self, run_dir: Path) -> bool:
        job_id, address = job_of(run_dir)
        if job_id is None:
            return False
        try:
            info = job_info(address, job_id)
        except RayError:
            return True  # the head does not answer: the job may well go on; say nothing ended
        return info is not None and str(info.status) not in TERMINAL

    def where(self, run_dir: Path, live: bool) -> str | None:
        job_id, address = job_of(run_dir)
        if job_id is None or not live:
            return job_id and f"Ray job {job_id}"
        try:
            info = job_info(address, job_id)
        except RayError as error:
            return f"Ray job {job_id}: its state is unknown while Ray does not answer ({error})"
        if info is None:
            return forgotten(job_id, address)
        said = f": {info.message}" if info.message and str(info.status) not in ("RUNNING", "SUCCEEDED") else ""
        return f"Ray job {job_id}: {info.status}{said} (dashboard {address})"

    def stop(self, run_dir: Path, grace_s: float) -> None:
        """Ray stops the job (SIGTERM to its driver, which passes it to every node's supervisor); wait
        until the job is over and every node's supervisor recorded its end, then say "stopped"
        when the run did not."""
        job_id, address = job_of(run_dir)
        if job_id is None:
            if not has_final_status(run_dir):
                events.append(run_dir / EVENTS, events.status("stopped", reason="stopped before it was submitted"))
            return
        if not self.alive(run_dir):
            self.record_ending(run_dir, 0.0)
            return
        try:
            client(address).stop_job(job_id)
        except (RayError, RuntimeError, OSError) as error:
            raise StopError(f"Ray did not stop job {job_id} of run {run_dir.name} ({error}): stop it again when the "
                            f"cluster at {address} answers, or with `ray job stop {job_id}`") from error
        deadline = time.monotonic() + max(grace_s, STOP_WAIT_S)
        while self.alive(run_dir) or any("ended" not in r for r in node_records(run_dir, job_id)):
            if time.monotonic() > deadline:
                raise StopError(f"Ray job {job_id} of run {run_dir.name} has nodes still running after its stop: "
                                f"see `ray job status {job_id} --address {address}`, and stop it again")
            time.sleep(0.5)
        if not has_final_status(run_dir):
            events.append(run_dir / EVENTS, events.status("stopped", reason=f"Stop now: Ray stopped job {job_id}"))

    def ending(self, run_dir: Path, created: float) -> Ending | None:
        return _ending(run_dir, created)[0]

    def record_ending(self, run_dir: Path, created: float) -> Ending | None:
        return recorded(run_dir, *_ending(run_dir, created))


def entrypoint(python: str, run_dir: str, job_id: str) -> list[str]:
    return [python, "-m", "studio_core.backends.ray.job", run_dir, job_id]


def _ending(run_dir: Path, created: float) -> tuple[Ending | None, list[dict]]:
    """How a run with no final status ended (None while it may be starting), and the events that
    record it (none when the run's events already say, or Ray does not answer). Reads only."""
    job_id, address = job_of(run_dir)
    info = None
    if job_id is None:
        if time.time() - created < STARTING_GRACE_S:
            return None, []
        ending = Ending("failed", "the run was never submitted to Ray: see its log")
    else:
        try:
            info = job_info(address, job_id)
        except RayError as error:
            return Ending("failed", f"Ray job {job_id}: {error}"), []  # unknown until Ray answers: nothing recorded
        ending = Ending("failed", forgotten(job_id, address)) if info is None else ray_ending(
            job_id, str(info.status), info.message or "")
    run = events.fold(events.read(run_dir / EVENTS))
    if run.state in events.FINAL_STATES:
        return ending, []
    head_restarted = job_id is not None and info is None  # the reason, not what the ranks said as they lost each other
    if ending.state == "failed" and not head_restarted:
        first = first_failed_node(node_records(run_dir, job_id)) if job_id else None
        if first:
            ending = Ending("failed", f"Ray job {job_id}: {first}; resume from the last checkpoint")
        elif run.errors and run.errors[-1]["time"] > submitted(run_dir):
            return Ending("failed", run.errors[-1].get("message", "")), [events.status("failed")]  # its error says it
    return ending, [*([events.error(ending.reason)] if ending.state == "failed" else []),
                    events.status(ending.state, reason=ending.reason)]


def ray_ending(job_id: str, status: str, message: str) -> Ending:
    """How a Ray job that left no final status ended, from Ray's job status and message."""
    if status == "STOPPED":
        return Ending("stopped", f"Ray job {job_id} was stopped outside the studio (ray job stop)")
    if status == "FAILED":
        return Ending("failed", f"Ray job {job_id} failed: {message or 'see its log'}")
    return Ending("failed", f"Ray job {job_id} ended as {status} without a final status from the run: see its log")
