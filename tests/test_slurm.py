"""Runs on a real Slurm cluster: two compute daemons on this machine (tests/slurm_cluster.py).

Skipped where Slurm is not installed; .ci/run installs it, and fails when it is missing.
This file's tests share one cluster, owned by the pytest worker that runs the file (tests run a
file per worker); tests/test_slurm_array.py starts its own (its own ports and job ids).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import nothing_left
from slurm_cluster import SlurmCluster, available, cluster_for_tests
from studio_browser import browser  # noqa: F401 (a fixture)

from studio_core.backends.slurm.options import SlurmOptions
from studio_core.backends.slurm.records import JOB, job_of
from studio_core.machine.hardware import CPU_CORES_ENV, Hardware, cpu_hardware
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec, SpecError

pytestmark = pytest.mark.skipif(not available(), reason="Slurm is not installed (apt install slurm-wlm munge)")
ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny-sft.yaml"
LONG = ["max_steps=100000", "logging_steps=50"]
# The test cluster's two nodes share this machine's CPUs: plan each as a 1-core node (one thread
# per rank), as Plan for / --instance plans a real cluster's nodes.
NODE = Hardware("cpu", 1, cpu_count=1)
ONE_CPU = {CPU_CORES_ENV: str(sorted(os.sched_getaffinity(0))[0])}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The 2-node cluster for this file; Slurm's commands (here and in the runs) find it by SLURM_CONF."""
    with cluster_for_tests(tmp_path_factory.mktemp("slurm")) as started:
        yield started


def slurm_spec(*overrides: str, nodes: int = 2, **options) -> RunSpec:
    spec = RunSpec.load(RECIPE).with_overrides(["studio.run_on=slurm", f"studio.nodes={nodes}", *overrides])
    spec.layout.options = SlurmOptions(**options)
    return spec


@pytest.fixture(scope="module")
def timed_run(cluster, tmp_path_factory):
    """A run that meets its one-minute time limit, started when the file's first test asks for it
    so that the minute passes while the other tests run: alone on partition short (node n3), a
    GRPO run whose reward function takes seconds (as a judge model would), so the minute costs
    little CPU. -> (its manager, its id)."""
    folder = tmp_path_factory.mktemp("timed")
    slow = folder / "slow_reward.py"
    slow.write_text("import time\n\n\ndef slow(completions, **kwargs):\n    time.sleep(2)\n"
                    "    return [0.0] * len(completions)\n")
    spec = RunSpec.load(ROOT / "recipes" / "tiny-grpo.yaml").with_overrides(
        ["studio.run_on=slurm", "max_steps=100000", f"studio.rewards=[{{file: {slow}, function: slow}}]"])
    spec.layout.options = SlurmOptions(partition="short", time="0:01")
    manager = RunManager(folder / "runs")
    return manager, manager.start(spec, NODE).id


def cli(*args: str, runs_dir: Path, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "launch.py", *args, "--runs-dir", str(runs_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **ONE_CPU})
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_two_nodes_headless_stop_and_save_resume_and_the_losses_of_a_local_two_process_run(
        cluster, timed_run, two_process_runs, tmp_path):
    runs = tmp_path / "runs"  # (timed_run: its minute starts now, on a node of its own)
    steps = ["--set", "max_steps=40", "--set", "logging_steps=1"]
    out = cli("train", str(RECIPE), "--backend", "cpu", "--slurm", "--nodes", "2", "--partition", "trn",
              "--time", "10", *steps, "--detach", runs_dir=runs).stdout
    assert "Slurm job" in out
    manager = RunManager(runs)
    [view] = manager.list()
    running = manager.wait(view.id, until=lambda v: v.step >= 3 or not v.active, timeout=120)
    assert "RUNNING on n[1-2]" in running.where()
    assert manager.core_holders(cpu_hardware()) == {}  # Slurm owns the nodes: no core of this machine leased
    manager.stop_and_save(view.id)  # the control file every rank reads
    stopped = manager.wait(view.id, timeout=120)
    assert stopped.live_state == "stopped" and stopped.resume_point() is not None, stopped.log_tail()
    saved = stopped.resume_point()["step"]
    assert 3 <= saved < 40

    out = cli("train", "--resume", view.id, "--backend", "cpu", "--detach", runs_dir=runs).stdout
    assert f"resumed from step {saved}" in out
    slurm_run = manager.wait(view.id, timeout=180)
    assert slurm_run.live_state == "finished", slurm_run.log_tail()
    assert slurm_run.world_size == 2 and slurm_run.step == 40 and slurm_run.attempts == 2
    ids = json.loads((slurm_run.dir / JOB).read_text())["job_ids"]
    assert len(ids) == 2 and ids[0] != ids[1]  # resubmitted into the same run folder
    assert {sample.get("node") for sample in slurm_run.hardware} == {"n1", "n2"}  # each node samples itself
    import gradio as gr

    from app.hardware_panel import HardwarePanel
    with gr.Blocks():
        panel = HardwarePanel()
    assert set(panel.render(slurm_run)[panel.cpu]["node"]) == {"n1", "n2"}  # a line per node
    # every node's output, labelled (the whole log: its tail may be all one node's torchrun shutting
    # down, when the other node's agent, which hosts the rendezvous store, ended first)
    log = (slurm_run.dir / "train.log").read_text(errors="replace").splitlines()
    assert any(line.startswith("0: ") for line in log) and any(line.startswith("1: ") for line in log)
    assert "#SBATCH --nodes=2" in (slurm_run.dir / "slurm.sh").read_text()
    listed = cli("runs", runs_dir=runs).stdout
    assert f"[Slurm job {job_of(slurm_run.dir)}]" in listed and "finished" in listed

    local = RunManager(two_process_runs.runs_dir).view(two_process_runs.ids["run"])  # the session's, trained once
    assert local.live_state == "finished" and local.world_size == 2
    # the same data-parallel training, two ways (two nodes x one process, with a stop and a resume;
    # one node x two processes), step for step
    assert [s for s, _ in slurm_run.losses()] == [s for s, _ in local.losses()] == list(range(1, 41))
    assert [loss for _, loss in slurm_run.losses()] == pytest.approx([loss for _, loss in local.losses()],
                                                                     rel=1e-4)


def test_bad_slurm_input_is_refused_before_anything_is_submitted(cluster, tmp_path, monkeypatch):
    manager = RunManager(tmp_path / "runs")
    refused = {
        "partition": (slurm_spec(partition="gpu"), "not a partition of this cluster; choose one of trn"),
        "nodes": (slurm_spec(nodes=3), "partition trn has 2 node(s); ask for at most 2"),
        "time": (slurm_spec(time="1:2:3:4"), "hours:minutes:seconds"),
        "owned option": (slurm_spec(sbatch_args=["--output=x.log"]), "the studio owns --output"),
        "short owned option": (slurm_spec(sbatch_args=["-N", "4"]), "the studio owns --nodes"),
        "cores": (slurm_spec("studio.cores='0'"), "leave cores empty for a Slurm run"),
    }
    for what, (spec, message) in refused.items():
        with pytest.raises(SpecError, match=re.escape(message)):
            manager.start(spec, cpu_hardware())
    down = tmp_path / "down.conf"  # a cluster whose controller does not answer
    down.write_text(cluster.conf.read_text().replace("SlurmctldPort=", "SlurmctldPort=1")  # nothing listens
                    .replace("KillWait=", "MessageTimeout=2\nKillWait="))  # sinfo gives up in 1 s, not 9
    monkeypatch.setenv("SLURM_CONF", str(down))
    with pytest.raises(SpecError, match="Slurm: `sinfo -h"):
        manager.start(slurm_spec(), NODE)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SpecError, match="`sinfo` is not on PATH: run the studio on a Slurm login node"):
        manager.start(slurm_spec(), NODE)
    monkeypatch.undo()
    assert [p.name for p in manager.runs_dir.iterdir() if not p.name.startswith(".")] == []
    assert cluster.run("squeue", "-h", "-p", "trn").stdout.strip() == ""  # (the timed run is on partition short)


def test_sbatch_refusing_the_job_leaves_no_run_folder(cluster, tmp_path):
    manager = RunManager(tmp_path / "runs")
    with pytest.raises(SpecError, match="not submitted: sbatch refused the job"):
        manager.start(slurm_spec(sbatch_args=["--mem=999999999"]), NODE)
    assert [p.name for p in manager.runs_dir.iterdir() if not p.name.startswith(".")] == []


def test_slurm_is_planned_without_a_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no Slurm command reachable
    out = cli("plan", str(RECIPE), "--slurm", "--nodes", "2", "--instance", "trn2.48xlarge", "--nproc", "32",
              "--time", "2:00:00", "--no-forecast", runs_dir=tmp_path / "runs").stdout
    for text in ("#SBATCH --nodes=2", "#SBATCH --time=2:00:00", "export FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA",
                 "--nproc-per-node=32", "sbatch --parsable slurm.sh", "srun --label"):
        assert text in out
    assert "NEURON_RT_VISIBLE_CORES" not in out  # each node is the job's: every core of it
    assert "is on this machine's own disk" in out  # a runs folder under /tmp, for two nodes


@pytest.mark.skipif(not shutil.which("chromium") and not Path("/usr/bin/chromium").exists(),
                    reason="Debian's chromium is not installed")
def test_a_two_node_run_from_the_page_waits_for_a_node_that_dies_then_finishes(cluster, browser, tmp_path):
    from playwright.sync_api import expect
    from studio_browser import App, open_page, run_state, set_number, stop_runs

    manager = RunManager(tmp_path / "other-runs")  # another user's job holds a node
    blocker = manager.start(slurm_spec(*LONG, nodes=1), NODE)
    node = manager.wait(blocker.id, until=lambda v: v.step >= 2, timeout=120).where().rsplit(" on ", 1)[-1]
    runs = tmp_path / "runs"
    runs.mkdir()
    app = App(runs, env={**os.environ, **cluster.env, **ONE_CPU})
    try:
        page = open_page(browser, app.url)
        set_number(page, "max_steps", 8)
        page.get_by_text("Layout: processes, parallelism, cores").click()
        page.locator("#run_on").get_by_text("Slurm", exact=True).click()
        expect(page.locator("#partition")).to_contain_text("trn: 2 node(s) (default)")
        set_number(page, "nodes", 2)
        expect(page.locator("#core-map")).to_contain_text("x 2 nodes", timeout=30_000)
        page.locator("#preview").click()
        plan = page.locator("#plan")
        plan.get_by_text("#SBATCH --nodes=2").first.wait_for()
        assert "sbatch --parsable slurm.sh" in plan.inner_text()
        page.locator("#start").click()
        expect(page.locator("#train-message")).to_contain_text("Slurm job", timeout=30_000)
        status = page.locator(".run-status").first
        expect(status).to_contain_text("PENDING (Resources)", timeout=30_000)  # Slurm's state and reason
        assert "STARTING" in status.inner_text()

        cluster.kill_node(node)  # the blocker's node dies: its slurmd and everything on it
        try:
            dead = manager.wait(blocker.id, timeout=180)
            assert dead.live_state == "failed", dead.error_text
            assert f"node {node} of Slurm job {job_of(dead.dir)} went down" in dead.error_text
            assert "Not responding" in dead.error_text  # Slurm's reason
            nothing_left(blocker.id)
            again = RunManager(manager.runs_dir).view(blocker.id)  # a restarted app: the same ending
            assert again.live_state == "failed" and "went down" in again.error_text
        finally:
            cluster.start_node(node)  # it comes back (ReturnToService=2); the page's job then runs
        run_state(page, "FINISHED").wait_for(timeout=180_000)
        shown = status.inner_text()
        assert "Slurm job" in shown and "2 processes" in shown and "loss" in shown
        [view] = app.runs()
        assert view.spec["studio"]["nodes"] == 2 and view.spec["studio"]["run_on"] == "slurm"
        page.close()
    finally:
        app.kill()
        stop_runs(runs)
        cluster.wait_idle(120)


def test_a_node_whose_supervisor_dies_is_named_as_the_one_that_failed_first(cluster, tmp_path):
    manager = RunManager(tmp_path / "runs")
    run = manager.start(slurm_spec(*LONG), NODE)
    manager.wait(run.id, until=lambda v: v.step >= 1 or not v.active, timeout=180)
    [supervisor] = [p for p in cluster.processes("n2") if "studio_core.training.supervisor" in " ".join(p.cmdline())]
    supervisor.kill()  # the other node's ranks then see only gloo's "Connection reset by peer"
    ended = manager.wait(run.id, timeout=180)
    assert ended.live_state == "failed"
    assert f"Slurm job {job_of(ended.dir)}: node n2 (host " in ended.error_text, ended.error_text
    assert "failed first: its supervisor ended without recording its end" in ended.error_text
    nothing_left(run.id)


def test_stop_now_a_job_cancelled_outside_and_one_that_met_its_time_limit(cluster, timed_run, tmp_path):
    # last in the file: the timed run's minute has passed meanwhile
    runs = tmp_path / "runs"
    manager = RunManager(runs)
    running = manager.start(slurm_spec(*LONG, nodes=1), NODE)
    manager.wait(running.id, until=lambda v: v.step >= 1, timeout=120)
    cancelled = manager.start(slurm_spec(*LONG), NODE)
    manager.wait(cancelled.id, until=lambda v: "PENDING" in (v.where() or ""), timeout=30)
    cluster.run("scancel", job_of(cancelled.dir))  # outside the studio
    gone = manager.wait(cancelled.id, timeout=60)
    assert gone.live_state == "stopped" and "cancelled outside the studio" in gone.reason

    assert f"Run {running.id}: stopped" in cli("stop", running.id, runs_dir=runs).stdout  # Stop now: scancel
    stopped = manager.view(running.id)
    assert stopped.live_state == "stopped" and "Stop now" in stopped.reason
    nothing_left(running.id)  # on any node

    timed_manager, timed_id = timed_run
    ended = timed_manager.wait(timed_id, timeout=180)
    assert ended.live_state == "failed" and "time limit (00:01:00)" in ended.error_text, ended.error_text
    nothing_left(timed_id)
    assert cluster.run("squeue", "-h").stdout.strip() == ""

    # a restarted app reads the same endings from the folders, after Slurm has let the jobs go
    again = {view.id: view for view in RunManager(runs).list()}
    assert again[cancelled.id].live_state == "stopped" and "cancelled outside" in again[cancelled.id].reason
    assert again[running.id].live_state == "stopped" and "Stop now" in again[running.id].reason
    assert "time limit" in RunManager(timed_manager.runs_dir).view(timed_id).error_text
    assert "cancelled outside the studio" in cli("runs", runs_dir=runs).stdout


def sbatch(cluster: SlurmCluster, script: Path) -> str:
    """Plain sbatch, as a user submits an exported script (its slurm-<id>.out goes beside it)."""
    done = subprocess.run(["sbatch", "--parsable", str(script)], cwd=script.parent, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **cluster.env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def test_an_exported_script_run_by_plain_sbatch_trains_on_two_nodes_as_a_run_of_the_studio(cluster, tmp_path):
    runs, script = tmp_path / "runs", tmp_path / "job.sh"
    out = cli("plan", str(RECIPE), "--backend", "cpu", "--slurm-script", str(script), "--nodes", "2", "--set",
              "max_steps=6", "--set", "logging_steps=1", "--no-forecast", runs_dir=runs).stdout
    run_id = re.search(r"run (\S+): submit it with `sbatch", out).group(1)
    job_id = sbatch(cluster, script)
    deadline = time.monotonic() + 120
    while not (runs / run_id / "spec.yaml").exists():  # the job makes the folder when it starts
        assert time.monotonic() < deadline, [p.read_text() for p in tmp_path.glob("slurm-*.out")]
        time.sleep(0.5)
    manager = RunManager(runs)
    view = manager.wait(run_id, timeout=240)
    assert view.live_state == "finished", view.log_tail()
    assert view.world_size == 2 and view.step == 6 and view.where() == f"Slurm job {job_id}"
    assert f"Slurm job {job_id} runs on n[1-2]" in (view.dir / "events.jsonl").read_text()
    [line] = [line for line in cli("runs", runs_dir=runs).stdout.splitlines() if line.startswith(run_id)]
    assert " finished " in line and "6/6" in line and f"[Slurm job {job_id}]" in line

    again = sbatch(cluster, script)  # the same script once more: its job refuses to start the run anew
    while cluster.run("squeue", "-h", "-j", again).stdout.strip():
        assert time.monotonic() < deadline + 240, "the second job did not end"
        time.sleep(0.5)
    assert "has ended (finished)" in (tmp_path / f"slurm-{again}.out").read_text()
    assert manager.view(run_id).live_state == "finished" and job_of(view.dir) == job_id
