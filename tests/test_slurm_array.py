"""A sweep's Slurm runs as one job array (studio_core.backends.slurm.array): what is refused before
anything is submitted, the array's script, array task ids as squeue lists them and as a task
records itself; and on a real Slurm cluster (tests/slurm_cluster.py), runs submitted as one
throttled array, each followed, stopped and ended under its own task id `<array id>_<i>`.
"""

from __future__ import annotations

import json
import time
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import nothing_left
from slurm_cluster import available, cluster_for_tests

from studio_core import backends
from studio_core.backends.base import SubmitError
from studio_core.backends.slurm import array, tools
from studio_core.backends.slurm.node import this_node
from studio_core.backends.slurm.options import SlurmOptions
from studio_core.backends.slurm.records import JOB, SCRIPT, job_in, job_of, node_records
from studio_core.machine.hardware import CPU_CORES_ENV, Hardware, cpu_hardware
from studio_core.recipe.spec import RunSpec
from studio_core.runs.manager import RunManager
from studio_core.training.plan import plan

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny-sft.yaml"
NODE = Hardware("cpu", 1, cpu_count=1)  # each test node as a 1-core machine (test_slurm.py says why)


def slurm_spec(*overrides: str, nodes: int = 1, **options) -> RunSpec:
    spec = RunSpec.load(RECIPE).with_overrides(["studio.run_on=slurm", f"studio.nodes={nodes}", *overrides])
    spec.layout.options = SlurmOptions(**options)
    return spec


def planned(tmp_path: Path, name: str, nodes: int = 1, **options):
    """(run folder, plan) of a Slurm run planned without a cluster; the folder is not made."""
    run_dir = tmp_path / "runs" / name
    return run_dir, plan(slurm_spec(nodes=nodes, **options), cpu_hardware(), run_dir=run_dir, run_id=name,
                         compile_cache=tmp_path / "cache")


@pytest.mark.fast
def test_runs_whose_job_options_differ_are_refused_as_one_array_naming_the_setting(tmp_path):
    same = [planned(tmp_path, name)[1] for name in ("a", "b")]
    assert array.problems(same) == []
    [nodes] = array.problems([*same, planned(tmp_path, "c", nodes=2)[1]])
    assert nodes.startswith("studio.nodes differs between the sweep's runs (1, 2)") and "separate sweep" in nodes
    [partition, qos] = array.problems([*same, planned(tmp_path, "d", partition="short", sbatch_args=["--qos=high"])[1]])
    assert partition.startswith("studio.slurm.partition differs between the sweep's runs ((not set), short)")
    assert qos.startswith("studio.slurm.sbatch_args --qos differs")
    assert array.problems([planned(tmp_path, "e", account="a;b")[1]])[0].startswith("studio.slurm.account:")
    for runs, parallel, says in (([], None, "no runs to submit"),
                                 ([planned(tmp_path, "a")], 0, "parallel: 0 is not a number of runs at once"),
                                 ([planned(tmp_path, "a"), planned(tmp_path, "c", nodes=2)], None, "studio.nodes"),
                                 ([(tmp_path / "runs" / "x", same[0])], None, "was paired with the plan of")):
        with pytest.raises(SubmitError, match=says):
            array.submit(tmp_path / "sweeps" / "s.slurm.sh", runs, parallel)
    assert not (tmp_path / "sweeps").exists()  # refused before anything was written


@pytest.mark.fast
def test_several_runs_as_one_is_a_backend_s_capability_slurm_s_being_its_job_array(tmp_path):
    """A sweep asks the backend (the registry's), never its name: Slurm takes its runs as one job
    array, the others one by one."""
    slurm = backends.get("slurm")
    assert slurm.group == "job array" and [b.name for b in backends.BACKENDS.values() if b.group] == ["slurm"]
    mixed = [planned(tmp_path, "a")[1], planned(tmp_path, "c", nodes=2)[1]]
    assert slurm.group_problems(mixed) == array.problems(mixed) and slurm.group_problems(mixed[:1]) == []
    with pytest.raises(SubmitError, match="studio.nodes differs"):  # refused before anything is written
        slurm.submit_group(tmp_path / "sweeps", "sweep-x", [planned(tmp_path, "a"), planned(tmp_path, "c", nodes=2)],
                           None)
    assert not (tmp_path / "sweeps").exists()
    for name in ("local", "ray"):
        with pytest.raises(SubmitError, match="takes its runs one by one"):
            backends.get(name).submit_group(tmp_path / "sweeps", "sweep-x", [planned(tmp_path, "a")], None)


@pytest.mark.fast
def test_the_array_script_carries_the_job_options_and_runs_the_task_s_own_run_script(tmp_path):
    runs = [planned(tmp_path, name, time="10") for name in ("a", "b b")]
    script = tmp_path / "runs" / "sweeps" / "sweep-x.slurm.sh"
    text = array.array_script(script, runs, parallel=1)
    for line in ("#SBATCH --job-name=sweep-x", "#SBATCH --nodes=1", "#SBATCH --exclusive", "#SBATCH --no-requeue",
                 "#SBATCH --time=10", f"#SBATCH --output={script.parent}/sweep-x-%A_%a.out",
                 "# `sbatch --parsable --array=0-1%1 sweep-x.slurm.sh` (at most 1 at once)."):
        assert line in text.splitlines(), text
    for run_dir, _ in runs:  # what each task runs, as bash runs it (a stand-in slurm.sh that says so)
        run_dir.mkdir(parents=True)
        (run_dir / SCRIPT).write_text('echo "ran $0"\n')
    for task, (run_dir, _) in enumerate(runs):
        done = subprocess.run(["bash", "-c", text], capture_output=True, text=True,
                              env={**os.environ, "SLURM_ARRAY_TASK_ID": str(task)})
        assert done.stdout == f"ran {run_dir / SCRIPT}\n", done.stderr
    alone = subprocess.run(["bash", "-c", text], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "SLURM_ARRAY_TASK_ID"})
    assert alone.returncode != 0 and "submit it with sbatch --array=0-1" in alone.stderr
    assert "%%/sweep-x-%A_%a.out" in array.array_script(tmp_path / "1%" / "sweep-x.slurm.sh", runs)  # % of a path


@pytest.mark.fast
def test_an_array_task_is_read_from_squeue_s_lines_and_records_itself_as_the_array_s_task(tmp_path, monkeypatch):
    # squeue -r lists each task; without -r (or asked for several) the waiting ones share one line
    assert tools.parse_squeue("58_2", "58_0|RUNNING|None|n1\n58_2|PENDING|JobArrayTaskLimit|\n").describe() == (
        "Slurm job 58_2: PENDING (JobArrayTaskLimit)")
    assert tools.parse_squeue("58_0", "58_[1-3%1]|PENDING|JobArrayTaskLimit|\n58_0|RUNNING|None|n1\n").describe() == (
        "Slurm job 58_0: RUNNING on n1")
    for listed, task, holds in (("58_[1-3%1]", "58_3", True), ("58_[1,3-5:2]", "58_4", False),
                                ("58_[1,3-5:2]", "58_5", True), ("58_[1-3]", "580_2", False), ("58", "58_0", False)):
        assert tools.lists(listed, task) is holds, (listed, task)
    assert tools.parse_squeue("58_4", "58_[1-3%1]|PENDING|JobArrayTaskLimit|\n") is None
    assert tools.parse_squeue("7", "PENDING|Resources|\n").state == "PENDING"  # a line without the id is the job's
    assert tools.array_task("58_12") == ("58", 12) and tools.array_task("58") is None
    assert tools.parse_sacct("CANCELLED by 0|0:0|None assigned|UNLIMITED\n") == {
        "JobState": "CANCELLED", "ExitCode": "0:0", "NodeList": "", "TimeLimit": "UNLIMITED"}
    assert tools.parse_sacct("") is None

    # inside a task, SLURM_JOB_ID is the task's own number; the run knows it as the array's task
    task = {"SLURM_JOB_ID": "61", "SLURM_ARRAY_JOB_ID": "58", "SLURM_ARRAY_TASK_ID": "2", "SLURMD_NODENAME": "n1",
            "SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "0"}
    assert job_in(task) == "58_2" and job_in({"SLURM_JOB_ID": "61"}) == "61" and job_in({}) is None
    for key, value in task.items():
        monkeypatch.setenv(key, value)
    node = this_node(tmp_path)
    assert node.job_id == "58_2" and node.number == "61" and node.first


needs_slurm = pytest.mark.skipif(not available(), reason="Slurm is not installed (apt install slurm-wlm munge)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A cluster of this file's own; Slurm's commands (here and in the runs) find it by SLURM_CONF."""
    with cluster_for_tests(tmp_path_factory.mktemp("slurm")) as started:
        yield started


@needs_slurm
def test_a_sweep_s_runs_go_as_one_throttled_job_array_each_followed_and_stopped_as_its_own_task(cluster, tmp_path):
    manager = RunManager(tmp_path / "runs")
    plans = []
    views = [manager.start(slurm_spec("max_steps=4", "logging_steps=1"), NODE, submit=False, planned=plans.append)
             for _ in range(4)]
    assert all(job_of(view.dir) is None for view in views)  # folders made, nothing submitted
    script = manager.runs_dir / "sweeps" / "sweep-test.slurm.sh"
    job = array.submit(script, [(view.dir, p) for view, p in zip(views, plans)], parallel=1)
    assert [job_of(view.dir) for view in views] == [f"{job}_{task}" for task in range(4)]
    said = (views[2].dir / "events.jsonl").read_text()
    assert f"submitted to Slurm as job {job}_2 (task 2 of job array {job})" in said

    first = manager.wait(views[0].id, until=lambda v: "RUNNING" in (v.where() or "") or not v.active, timeout=60)
    assert f"Slurm job {job}_0: RUNNING on n" in first.where()
    for view in views[1:]:  # at most one task at once: the others wait, and read so
        waiting = manager.view(view.id)
        assert waiting.backend.alive(waiting.dir) and waiting.live_state == "starting"
        assert waiting.where() == f"Slurm job {job}_{views.index(view)}: PENDING (JobArrayTaskLimit)"

    cluster.run("scancel", f"{job}_2")  # outside the studio: Slurm drops a waiting task at once, with no record
    stopped = manager.stop(views[1].id)  # Stop now: scancel of one waiting task
    assert stopped.live_state == "stopped" and f"Slurm cancelled job {job}_1" in stopped.reason
    gone = manager.wait(views[2].id, timeout=30)
    assert gone.live_state == "stopped" and "cancelled on its own" in gone.reason, gone.reason
    assert manager.view(views[0].id).live_state in ("starting", "running")  # both were cancelled while it ran
    assert node_records(stopped.dir, f"{job}_1") == node_records(gone.dir, f"{job}_2") == []  # never started

    for task in (0, 3):  # the others run, one after the other, each as its own task
        done = manager.wait(views[task].id, timeout=180)
        assert done.live_state == "finished" and done.step == 4, done.log_tail()
        assert json.loads((done.dir / JOB).read_text())["job_ids"] == [f"{job}_{task}"]
        assert [r["node"] for r in node_records(done.dir, f"{job}_{task}")]  # its node recorded under the task's id
        assert done.where() == f"Slurm job {job}_{task}"
        said = (script.parent / f"sweep-test-{job}_{task}.out").read_text()  # Slurm's own lines of the task
        assert f"studio: Slurm job {job}_{task} runs run {done.id}" in said
        nothing_left(done.id)
    deadline = time.monotonic() + 30  # Slurm says COMPLETING while it ends the task's job steps
    while tools.record(f"{job}_3")["JobState"] == "COMPLETING" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tools.record(f"{job}_3")["JobState"] == "COMPLETED"  # an ended task, as scontrol keeps it
    assert [manager.view(view.id).live_state for view in views] == ["finished", "stopped", "stopped", "finished"]


@needs_slurm
def test_launch_py_sweep_slurm_submits_one_array_and_refuses_a_grid_over_the_job_options(cluster, tmp_path):
    runs = tmp_path / "runs"
    one_cpu = {**os.environ, CPU_CORES_ENV: str(sorted(os.sched_getaffinity(0))[0])}  # each node as 1 core

    def sweep(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "launch.py", "sweep", str(RECIPE), "--backend", "cpu", "--slurm",
                               "--set", "max_steps=3", *args, "--runs-dir", str(runs)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, env=one_cpu)

    refused = sweep("--grid", "studio.nodes=1,2")
    assert refused.returncode == 2 and "studio.nodes differs between the sweep's runs" in refused.stderr
    assert not runs.exists() or [p.name for p in runs.iterdir() if not p.name.startswith(".")] == []
    done = sweep("--grid", "learning_rate=1e-3,3e-3", "--parallel", "1", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    (record,) = (runs / "sweeps").glob("*.json")
    saved = json.loads(record.read_text())
    job = saved["group"]["id"]
    assert saved["group"]["label"] == f"Slurm job array {job}" and f"Submitted as Slurm job array {job}" in done.stdout
    assert [job_of(runs / entry["id"]) for entry in saved["runs"]] == [f"{job}_0", f"{job}_1"]
    assert "best first by the last loss" in done.stdout and done.stdout.count(" finished ") == 2
