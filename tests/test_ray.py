"""Runs on a real Ray cluster: a head and a second node on this machine (tests/ray_cluster.py),
one CPU each, so a 2-node run's placement group puts one node's torchrun on each and their c10d
rendezvous really happens between two Ray nodes. Submitted, followed, stopped and resumed through
Ray's Jobs API, as `launch.py train --ray ADDRESS` does; two runs planned for Trainium on the node
that declares NeuronCores, each rank on a core Ray assigned; a node killed mid-run, and last the
head killed and started again."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from conftest import launch_py, nothing_left
from ray_cluster import NEURON_CORES, RAY, RayCluster, free_port
from studio_core.backends.ray.records import JOB
from studio_core.machine.device_env import VISIBLE, use_rank_core
from studio_core.machine.hardware import cpu_hardware, instance_hardware
from studio_core.machine.procs import run_processes
from studio_core.recipe.spec import RunSpec
from studio_core.rundir.folder import EVENTS
from studio_core.runs.manager import RunManager

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-sft.yaml"


@pytest.fixture(scope="module")
def cluster():
    ray = RayCluster.start()
    yield ray
    ray.stop()
    assert not ray.processes()


def cli(*args: str, runs_dir: Path, check: bool = True):
    done = launch_py(*args, "--runs-dir", str(runs_dir), timeout=300)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def job_ids(view) -> list[str]:
    return json.loads((view.dir / JOB).read_text())["job_ids"]


def test_two_ray_nodes_train_stop_and_save_resume_and_a_stop_from_outside(cluster, tmp_path):
    runs = tmp_path / "runs"
    out = cli("train", str(RECIPE), "--ray", cluster.address, "--nodes", "2", "--set", "max_steps=400",
              "--set", "logging_steps=1", "--detach", runs_dir=runs).stdout
    assert "Ray job studio-" in out
    manager = RunManager(runs)
    [view] = manager.list()
    running = manager.wait(view.id, until=lambda v: v.step >= 3 or not v.active, timeout=180)
    assert running.live_state == "running", running.log_tail()
    assert running.world_size == 2 and ": RUNNING" in running.where()
    assert manager.core_holders(cpu_hardware()) == {}  # Ray reserves the nodes: no core of this machine leased
    manager.stop_and_save(view.id)  # the control file every rank reads
    stopped = manager.wait(view.id, timeout=120)
    assert stopped.live_state == "stopped" and stopped.resume_point() is not None, stopped.log_tail()
    saved = stopped.resume_point()["step"]
    nothing_left(view.id, timeout=30)

    out = cli("train", "--resume", view.id, "--detach", runs_dir=runs).stdout
    assert f"resumed from step {saved}" in out
    again = manager.wait(view.id, until=lambda v: v.step > saved or not v.active, timeout=180)
    assert again.live_state == "running" and again.attempts == 2, again.log_tail()
    first, second = job_ids(again)
    assert first != second  # a new Ray job into the same run folder
    # stopped outside the studio: an honest ending, from Ray's own word, and nothing left on any node
    subprocess.run([RAY, "job", "stop", second, f"--address={cluster.address}"], check=True, capture_output=True,
                   timeout=120)
    ended = manager.wait(view.id, timeout=120)
    assert ended.live_state == "stopped", ended.log_tail()
    assert f"Ray job {second} was stopped outside the studio (ray job stop)" in cli("runs", runs_dir=runs).stdout
    nothing_left(view.id, timeout=30)
    assert {sample.get("node") for sample in ended.hardware} == {"n0", "n1"}  # each node samples itself


def test_a_run_finishes_on_two_ray_nodes_and_stop_now_leaves_nothing(cluster, tmp_path):
    runs = tmp_path / "runs"
    done = cli("train", str(RECIPE), "--ray", cluster.address, "--nodes", "2", "--set", "max_steps=20",
               runs_dir=runs)
    assert "finished (exit code 0)" in done.stdout, done.stdout + done.stderr
    manager = RunManager(runs)
    [view] = manager.list()
    assert view.world_size == 2 and view.step == 20
    assert f"[Ray job {job_ids(view)[0]}]" in cli("runs", runs_dir=runs).stdout
    cli("train", str(RECIPE), "--ray", cluster.address, "--nodes", "2", "--set", "max_steps=2000", "--detach",
        runs_dir=runs)
    [second] = [v for v in manager.list() if v.id != view.id]
    manager.wait(second.id, until=lambda v: v.step >= 1 or not v.active, timeout=180)
    stop = cli("stop", second.id, runs_dir=runs)
    assert "stopped" in stop.stdout
    assert manager.view(second.id).live_state == "stopped"
    assert f"Stop now: Ray stopped job {job_ids(second)[0]}" in cli("runs", runs_dir=runs).stdout
    nothing_left(second.id, timeout=30)


def test_bad_ray_input_is_refused_before_anything_is_submitted(cluster, tmp_path):
    runs = tmp_path / "runs"
    for args, said in ((["--ray", "10.0.0.5"], "--ray: '10.0.0.5' is not a Ray dashboard address"),
                       (["--ray", f"http://127.0.0.1:{free_port()}"], "no Ray cluster answers at"),
                       (["--ray", cluster.address, "--nodes", "3"], "has 2 node(s); ask for at most 2"),
                       (["--ray", cluster.address, "--nodes", "2", "--nproc", "2"],
                        "studio.nproc: the run asks Ray for 2 CPU on each of 2 node(s), and the cluster at "
                        f"{cluster.address} has fewer nodes with that many (its nodes have 1, 1 CPU): ask for at most "
                        "1 process(es) per node or fewer nodes"),
                       (["--nodes", "2"], "--nodes: a run on several machines goes to a cluster: add --slurm or "
                                          "--ray ADDRESS")):
        done = cli("train", str(RECIPE), *args, runs_dir=runs, check=False)
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not runs.exists() or not [p for p in runs.iterdir() if not p.name.startswith(".")]


def test_two_trainium_runs_on_one_node_each_get_their_own_cores_from_ray(cluster, tmp_path):
    """Two runs planned for a trn2.3xlarge go to the one node with NeuronCores (ray_cluster: 4,
    declared with `ray start --resources`), one of 2 processes and one of 1, both running at once.
    Each rank's NeuronCore is read from the rank itself: the environment its process started with,
    as the worker's first line reads it (`use_rank_core`, before torch loads); the ranks compute on
    the CPU here, which changes nothing of that. They must be Ray's ids, one per rank, none shared."""
    manager = RunManager(tmp_path / "runs")
    recipe = RunSpec.load(RECIPE).with_overrides([  # the ranks compute on the CPU: Neuron's bf16 and torch.compile off
        "studio.run_on=ray", f"studio.ray.address={cluster.address}", "max_steps=2000", "bf16=false",
        "torch_compile=false"])
    started = {manager.start(recipe.with_overrides([f"studio.nproc={nproc}"]), instance_hardware("trn2.3xlarge")).id:
               nproc for nproc in (2, 1)}
    try:
        seen = {run_id: ranks_cores(manager, run_id, nproc) for run_id, nproc in started.items()}
        for run_id in started:  # both still running: the ids of each were held while the other got its own
            assert manager.view(run_id).active, manager.view(run_id).log_tail()
        cores = [core for ranks in seen.values() for core in ranks.values()]
        assert None not in cores, seen  # a rank that sees no core takes core LOCAL_RANK, whatever else runs there
        assert len(set(cores)) == 3 and set(cores) <= {str(core) for core in range(NEURON_CORES)}, seen
        for run_id, ranks in seen.items():  # and the run's log says the same ids
            node = ",".join(ranks[rank] for rank in sorted(ranks))
            assert f"node n0 has neuron_cores {node}" in (manager.view(run_id).dir / EVENTS).read_text(), seen
    finally:
        for run_id in started:
            manager.stop(run_id)
    for run_id in started:
        nothing_left(run_id, timeout=30)


def ranks_cores(manager, run_id: str, nproc: int, timeout: float = 180) -> dict[int, str | None]:
    """Once every rank of the run is there: each local rank's NeuronCore, as that rank's worker sets
    it before torch loads, from the environment its process started with (/proc/PID/environ)."""
    deadline = time.monotonic() + timeout
    while True:
        ranks = {}
        for proc in run_processes(run_id):
            try:
                env, argv = proc.environ(), proc.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "LOCAL_RANK" in env and "studio_core.training.worker" in argv:
                ranks[int(env["LOCAL_RANK"])] = use_rank_core(env) or env.get(VISIBLE)
        if len(ranks) == nproc:
            return ranks
        view = manager.view(run_id)
        assert view.active and time.monotonic() < deadline, view.log_tail()
        time.sleep(0.5)


def test_a_node_that_goes_down_mid_run_is_named_and_nothing_is_left(cluster, tmp_path):
    """Next to last in this file: a Ray node of the cluster is killed (and joins again at the end)."""
    runs = tmp_path / "runs"
    manager, view = long_run_at_step_3(cluster, runs)
    try:
        cluster.kill_node(1)  # the second Ray node, with the run's supervisor, torchrun and rank there
        ended = manager.wait(view.id, timeout=180)
        assert ended.live_state == "failed", ended.log_tail()
        [gone] = [r["node"] for r in json_records(ended) if "ended" not in r]
        assert ended.error_text.startswith(f"Ray job {job_ids(ended)[0]}: node {gone} (host "), ended.error_text
        assert "failed first: its supervisor ended without recording its end" in ended.error_text
        nothing_left(view.id, timeout=30)
    finally:
        cluster.restart_node(1)


def test_a_restarted_head_ends_the_run_honestly_and_a_silent_head_is_said(cluster, tmp_path):
    """Last in this file: the head goes down mid-run, then starts again as a new cluster, which no
    longer knows the job (the other node rejoins it)."""
    runs = tmp_path / "runs"
    manager, view = long_run_at_step_3(cluster, runs)
    cluster.kill_node(0)  # the head, and the run's supervisor, torchrun and rank 0 on it
    [job] = job_ids(view)
    silent = cli("runs", runs_dir=runs).stdout  # said, not a traceback; the run is not called ended
    assert f"Ray job {job}: its state is unknown while Ray does not answer (no Ray cluster answers at" in silent
    assert manager.view(view.id).live_state == "running"
    stop = cli("stop", view.id, runs_dir=runs, check=False)
    assert stop.returncode == 1 and "Traceback" not in stop.stderr, stop.stdout + stop.stderr
    assert f"Not stopped: Ray did not stop job {job} of run {view.id}" in stop.stdout + stop.stderr
    cluster.restart_head()
    ended = manager.wait(view.id, timeout=120)
    assert ended.live_state == "failed", ended.log_tail()
    assert ended.error_text.startswith(f"Ray job {job}: the Ray cluster at {cluster.address} no longer knows it: "
                                       "its head was restarted"), ended.error_text
    assert "resume from the last checkpoint" in cli("runs", runs_dir=runs).stdout
    nothing_left(view.id, timeout=30)


def long_run_at_step_3(cluster, runs: Path):
    """A long run on both nodes, once it is at step 3: (its manager, its view)."""
    cli("train", str(RECIPE), "--ray", cluster.address, "--nodes", "2", "--set", "max_steps=2000", "--detach",
        runs_dir=runs)
    manager = RunManager(runs)
    [view] = manager.list()
    view = manager.wait(view.id, until=lambda v: v.step >= 3 or not v.active, timeout=180)
    assert view.live_state == "running", view.log_tail()
    return manager, view


def json_records(view) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((view.dir / "ray-nodes").glob("*.json"))]
