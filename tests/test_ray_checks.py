"""The Ray backend without a cluster: its options' rule, the plan it makes, and how it reads a Ray
job's end (tests/test_ray.py runs it on a real 2-node Ray cluster)."""

from __future__ import annotations

import pytest

from conftest import launch_py
from studio_core.backends import get
from studio_core.backends.ray.backend import ray_ending
from studio_core.backends.ray.options import RayOptions
from studio_core.machine.device_env import VISIBLE, given_cores, use_rank_core
from studio_core.recipe.spec import RunSpec

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("address", ["http://10.0.0.5:8265", "https://ray.example.com:443", "http://head:8265/"])
def test_a_dashboard_address_is_taken(address):
    assert RayOptions(address).check() == []


@pytest.mark.parametrize("address", ["10.0.0.5:8265", "ray://10.0.0.5:10001", "http://a b:1", 8265])
def test_anything_else_is_refused_saying_what_to_write(address):
    [problem] = RayOptions(address).check(labels={"address": "--ray"})
    assert problem.startswith(f"--ray: {address!r} is not a Ray dashboard address: write http://HOST:PORT")


def test_the_recipe_block_is_read_and_written_back_as_given():
    options, problems = RayOptions.from_dict({"address": "http://h:8265"})
    assert problems == [] and options.to_dict() == {"address": "http://h:8265"}
    _, problems = RayOptions.from_dict({"adress": "http://h:8265"})
    assert problems == ["studio.ray.adress: unknown key; it takes address (the head's dashboard address, e.g. "
                        "http://10.0.0.5:8265)"]
    assert RayOptions.from_dict(["http://h:8265"])[1] == ["studio.ray: must be a mapping of address"]


def test_a_ray_layout_needs_its_address_and_no_cores():
    spec = RunSpec.from_dict({"model_name_or_path": "builtin:tiny-qwen3", "dataset_name": "builtin:qa",
                              "studio": {"run_on": "ray", "nodes": 2, "cores": "0-1"}})
    problems = get("ray").layout_problems(spec.layout)
    assert any(p.startswith("studio.ray.address: give the Ray cluster's dashboard address") for p in problems)
    assert any(p.startswith("studio.cores: Ray picks the nodes") for p in problems)


def test_the_plan_shows_the_placement_group_and_the_job_without_asking_the_cluster(tmp_path):
    done = launch_py("plan", "recipes/tiny-sft.yaml", "--ray", "http://127.0.0.1:9", "--nodes", "2", "--no-forecast",
                     "--backend", "cpu", "--runs-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "Ray placement group = '2 x {CPU: 1}, STRICT_SPREAD'" in done.stdout
    assert "--rdzv-conf=is_host=$STUDIO_RAY_HOST" in done.stdout
    assert "-m studio_core.backends.ray.job" in done.stdout and "other nodes cannot see it" in done.stdout


def test_the_cores_ray_assigns_a_node_reach_its_ranks_as_a_local_runs_leased_cores_do():
    """The ids Ray assigned a node's actor become its ranks' cores, through the worker's own
    `use_rank_core` (test_ray.py sees them in real ranks on the cluster, for Neuron)."""
    from studio_core.backends.ray.job import claim, node_cores

    block = node_cores("neuron", ["2", "3"], 2)
    assert [use_rank_core({**block, "LOCAL_RANK": str(rank)}) for rank in (0, 1)] == ["2", "3"]
    assert node_cores("neuron", ["5"], 1) == {VISIBLE: "5"}  # one process: the runtime's own variable
    assert node_cores("cuda", ["0", "1"], 2) == {"CUDA_VISIBLE_DEVICES": "0,1"} and node_cores("cpu", [], 2) == {}
    with pytest.raises(RuntimeError, match=r"assigned this node's actor neuron_cores \['0', '1', '2'\], not one per "
                                           r"process \(2\)"):
        node_cores("neuron", ["0", "1", "2"], 2)
    # the node's supervisor samples those cores for the run's plots (a Slurm node's: its first nproc)
    assert given_cores("neuron", 2, block) == [2, 3] and given_cores("neuron", 1, {VISIBLE: "5"}) == [5]
    assert given_cores("cuda", 2, {"CUDA_VISIBLE_DEVICES": "2,3"}) == [2, 3] and given_cores("neuron", 2, {}) == [0, 1]
    # the actor asks for its bundle's devices itself (Ray assigns ids only then); CPUs have no ids
    assert (claim("neuron", 2), claim("cuda", 2), claim("cpu", 2)) == ({"resources": {"neuron_cores": 2}},
                                                                      {"num_gpus": 2}, {})


def test_a_ray_jobs_end_reads_as_the_studios():  # which node failed first: backends.nodes, test_hardening_slurm
    assert ray_ending("j1", "STOPPED", "").state == "stopped"
    assert ray_ending("j1", "FAILED", "driver died").reason == "Ray job j1 failed: driver died"
    assert ray_ending("j1", "SUCCEEDED", "").state == "failed"  # no final status from the run: its log says


def test_a_run_whose_cluster_does_not_answer_is_said_unknown_and_not_ended(tmp_path):
    """The head is down (or the address is gone): the run's place says its state is unknown, the
    run is not called ended, a stop says it could not stop it, and nothing is a traceback."""
    from ray_cluster import free_port
    from studio_core.backends.base import StopError
    from studio_core.backends.ray.backend import RayError, job_info
    from studio_core.backends.ray.records import record_job

    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RayError, match=f"^no Ray cluster answers at {address}: "):
        job_info(address, "studio-x-1")
    record_job(tmp_path, "studio-x-1", address, 0.0)
    ray = get("ray")
    assert ray.where(tmp_path, live=True).startswith(
        f"Ray job studio-x-1: its state is unknown while Ray does not answer (no Ray cluster answers at {address}")
    assert ray.alive(tmp_path)  # it may well go on: nothing is recorded as its end
    with pytest.raises(StopError, match=f"stop it again when the cluster at {address} answers, or with `ray job "
                                        "stop studio-x-1`"):
        ray.stop(tmp_path, grace_s=1.0)
