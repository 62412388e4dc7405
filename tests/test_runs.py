"""Real runs end to end: the tiny model, real torchrun on the CPU, real processes.

Each test starts runs in its own runs folder and follows them through RunView, as the
web app and the CLI do. Waits are RunManager.wait's: its deadline only guards against a
hang, it is not what is tested.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from studio_core.rundir.events import FINAL_STATES, read as read_events
from studio_core.machine import leases
from studio_core.machine.hardware import cpu_hardware, studio_cpus
from studio_core.machine.procs import kill_run_processes
from studio_core.rundir.folder import new_run_id
from studio_core.runs.manager import RunManager
from studio_core.runs.view import RunView
from conftest import launch_py, make_unloadable, run_folders
from studio_core.recipe.spec import RunSpec, SpecError

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny-sft.yaml"
LONG = ["max_steps=3000", "logging_steps=50"]  # still going when a test acts on it


def tiny(*overrides: str) -> RunSpec:
    return RunSpec.load(TINY).with_overrides(["max_steps=20", "logging_steps=5", *overrides])


def wait_until_training(manager: RunManager, run_id: str, steps: int = 5) -> RunView:
    """The run once it made `steps` steps, and still running (one that ended first fails here)."""
    view = manager.wait(run_id, lambda v: v.step >= steps or v.live_state in FINAL_STATES)
    assert view.live_state == "running", view.error_text
    return view


def marked_processes(run_id: str) -> dict[int, psutil.Process]:
    """Every live process whose environment carries STUDIO_RUN_ID=run_id, read here with psutil."""
    found = {}
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("STUDIO_RUN_ID") == run_id and proc.status() != psutil.STATUS_ZOMBIE:
                proc.create_time()  # cached on the object, for still_there() to compare later
                found[proc.pid] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def still_there(proc: psutil.Process) -> bool:
    """True while this very process (same pid and start time) exists, zombie or not."""
    if not psutil.pid_exists(proc.pid):
        return False
    try:
        return psutil.Process(proc.pid).create_time() == proc.create_time()
    except psutil.NoSuchProcess:
        return False


def running(proc: psutil.Process) -> bool:
    """This very process still exists and has not ended (a zombie has)."""
    try:
        return still_there(proc) and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until_gone(procs, timeout: float = 30) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while any(still_there(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in procs if still_there(p)]


def ranks(procs: dict[int, psutil.Process]) -> dict[str, psutil.Process]:
    out = {}
    for proc in procs.values():
        rank = proc.environ().get("RANK")
        if rank is not None and proc.environ().get("LOCAL_RANK") is not None:
            out[rank] = proc
    return out


def broken_model(folder: Path) -> Path:
    """A copy of the tiny model whose first tensor has a type safetensors does not know: its
    names, shapes and lengths are whole, so the pre-launch model check (which reads no tensor)
    passes, and loading the weights fails in the worker."""
    import shutil

    from studio_core.data.builtin import ensure_tiny_model

    path = folder / "broken-model"
    shutil.copytree(ensure_tiny_model(), path)
    make_unloadable(path / "model.safetensors")
    return path


@pytest.mark.fast
def test_a_malformed_line_among_the_first_rows_is_refused_before_launch(manager, tmp_path):
    path = tmp_path / "early.jsonl"
    good = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    path.write_text(json.dumps(good) + "\n{oops\n")
    with pytest.raises(SpecError) as refused:
        manager.start(tiny(f"dataset_name={path}"), cpu_hardware())
    assert "line 2 is not valid JSON" in str(refused.value)
    assert run_folders(manager.runs_dir) == []


# --- a whole run (the one-process CLI run: tests/test_readme.py, README's first train command) ---
def test_two_processes_run_data_parallel(two_process_runs):
    from studio_core.runs.manager import RunManager

    view = RunManager(two_process_runs.runs_dir).view(two_process_runs.ids["run"])
    assert view.state == "finished", view.error_text
    running = [e for e in read_events(view.dir / "events.jsonl")
               if e["type"] == "status" and e["state"] == "running"]
    assert [e["world_size"] for e in running] == [2]  # one rank 0, and DDP really on
    assert view.world_size == 2 and view.step == 40 and view.spec["studio"]["cores"] == "0-1"


# --- stopping and crashing --------------------------------------------------------------
@pytest.mark.parametrize("nproc", [1, 2])
def test_stop_ends_the_run_and_every_process_of_it(manager, nproc):
    """One process: the supervisor and the worker it started; two: the supervisor, torchrun and its ranks."""
    view = manager.start(tiny(*LONG, f"studio.nproc={nproc}"), cpu_hardware())
    wait_until_training(manager, view.id)
    procs = marked_processes(view.id)
    supervisor_pid = json.loads((view.dir / "supervisor.json").read_text())["pid"]
    assert supervisor_pid in procs
    assert len(procs) >= (2 if nproc == 1 else 4) and set(ranks(procs)) == {str(r) for r in range(nproc)}

    view = manager.stop(view.id)
    assert view.state == "stopped" and view.live_state == "stopped"
    assert view.exit_code is not None and view.error_text is None  # a stop is not a crash
    assert view.step < 3000
    assert wait_until_gone(procs.values()) == []
    assert marked_processes(view.id) == {}


def test_worker_exception_is_surfaced(manager, tmp_path):
    spec = tiny(f"model_name_or_path={broken_model(tmp_path)}")
    view = manager.start(spec, cpu_hardware())
    view = manager.wait(view.id)
    assert view.state == "failed"
    assert view.exit_code not in (0, None)
    (error,) = view.errors
    assert error["message"] and error["rank"] == 0
    assert "Traceback" in error["traceback"]
    assert view.error_text == error["message"]
    assert not (view.dir / "output" / "config.json").exists()


def test_a_killed_rank_fails_the_run_and_takes_the_rest_down(manager):
    view = manager.start(tiny("studio.nproc=2", *LONG), cpu_hardware())
    wait_until_training(manager, view.id)
    procs = marked_processes(view.id)
    rank1 = ranks(procs)["1"]
    rank1.send_signal(signal.SIGKILL)

    view = manager.wait(view.id)
    assert view.state == "failed"
    assert view.exit_code not in (0, None)
    assert view.error_text == "rank 1 was killed by SIGKILL; torchrun then ended the other ranks"
    assert wait_until_gone(procs.values()) == []


def test_a_one_process_run_has_no_torchrun_and_its_killed_rank_is_named(manager):
    """One process on this machine: the supervisor starts the worker itself, with torchrun's
    variables for its one rank; killed, the run says which rank and how, as torchrun's runs do."""
    view = manager.start(tiny(*LONG), cpu_hardware())
    wait_until_training(manager, view.id)
    procs = marked_processes(view.id)
    commands = [" ".join(p.cmdline()) for p in procs.values()]
    assert not any("torch.distributed.run" in c for c in commands), commands
    rank0 = ranks(procs)["0"]
    assert rank0.environ()["WORLD_SIZE"] == "1" and rank0.environ()["MASTER_PORT"]
    rank0.send_signal(signal.SIGKILL)
    view = manager.wait(view.id)
    assert view.state == "failed" and view.error_text == "rank 0 was killed by SIGKILL"
    assert wait_until_gone(procs.values()) == []


# --- the app goes away, the run does not -------------------------------------------------
START_ELSEWHERE = """
import sys
from studio_core.machine.hardware import cpu_hardware
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec
spec = RunSpec.load(sys.argv[2]).with_overrides(sys.argv[3:])
print(RunManager(sys.argv[1]).start(spec, cpu_hardware()).id)
"""


def test_a_restarted_app_finds_the_running_run(tmp_path):
    runs_dir = tmp_path / "runs"
    started = subprocess.run(
        [sys.executable, "-c", START_ELSEWHERE, str(runs_dir), str(TINY), "max_steps=200", "logging_steps=50"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=120, check=True)
    run_id = started.stdout.strip()
    try:
        manager = RunManager(runs_dir)  # the "new app": nothing in memory about the run
        (view,) = manager.list()
        assert view.id == run_id
        assert view.live_state in ("starting", "running")
        supervisor = psutil.Process(json.loads((view.dir / "supervisor.json").read_text())["pid"])
        assert supervisor.is_running() and supervisor.ppid() != os.getpid()  # not ours: the starter is gone

        first = wait_until_training(manager, run_id, steps=1).step
        grown = manager.wait(run_id, lambda v: v.step > first or v.live_state != "running")
        assert grown.step > first

        view = manager.wait(run_id)
        assert view.state == "finished", view.error_text
        assert view.step == 200 and (view.dir / "output" / "config.json").is_file()
    finally:
        kill_run_processes(run_id)

    listed = launch_py("runs", "--runs-dir", str(runs_dir), timeout=60)
    assert listed.returncode == 0, listed.stderr
    (line,) = [line for line in listed.stdout.splitlines() if run_id in line]
    assert line.split()[1:3] == ["finished", "200/200"]


@pytest.mark.fast
def test_a_run_folder_still_being_made_is_not_listed(manager):
    half_made = manager.runs_dir / ".creating-20260101-000000-tiny-sft"
    half_made.mkdir()
    RunSpec.load(TINY).save(half_made / "spec.yaml")
    assert manager.list() == []


# --- what is refused before anything starts ---------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("overrides", [["max_step=5"], ["studio.nproc=64"], ["studio.tp_size=2", "studio.nproc=2"]])
def test_bad_input_to_start_makes_nothing(manager, overrides):
    with pytest.raises(SpecError):
        manager.start(tiny(*overrides), cpu_hardware())
    assert run_folders(manager.runs_dir) == []


# --- the CLI ------------------------------------------------------------------------------
def test_cli_bad_set_says_what_to_change_and_starts_nothing(tmp_path):
    runs_dir = tmp_path / "runs"
    done = launch_py("train", str(TINY), "--runs-dir", str(runs_dir), "--backend", "cpu", "--set", "max_step=5")
    assert done.returncode == 2
    assert "max_step:" in done.stderr and "did you mean max_steps?" in done.stderr
    assert not runs_dir.exists() or run_folders(runs_dir) == []


def test_cli_train_reports_a_failed_run(tmp_path):
    runs_dir = tmp_path / "runs"
    done = launch_py("train", str(TINY), "--runs-dir", str(runs_dir), "--backend", "cpu",
                     "--set", f"model_name_or_path={broken_model(tmp_path)}")
    assert done.returncode == 1
    (run_dir,) = run_folders(runs_dir)
    error = RunManager(runs_dir).view(run_dir.name).error_text
    assert "failed" in done.stdout
    assert f"Error: {error}" in done.stderr
    assert str(run_dir / "train.log") in done.stderr


@pytest.mark.fast
def test_cli_plan_prints_the_command_and_runs_nothing(tmp_path):
    runs_dir = tmp_path / "runs"
    # --no-forecast: the shape forecast (a child process importing TRL) is test_forecast's part
    done = launch_py("plan", str(TINY), "--runs-dir", str(runs_dir), "--backend", "cpu",
                     "--set", "studio.nproc=2", "--no-forecast", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "torch.distributed.run --standalone --nnodes=1 --nproc-per-node=2" in done.stdout
    assert "use_cpu = True" in done.stdout
    assert not runs_dir.exists() or run_folders(runs_dir) == []


@pytest.mark.fast
def test_a_plan_for_another_machine_needs_no_network_and_no_cache(tmp_path, monkeypatch, capsys):
    """The Trainium quick start planned on a laptop whose Hugging Face cache is empty: the model and
    dataset are not fetched (the Hub stand-in is asked nothing) nor refused; one line says what was
    not checked and why, and the plan is printed."""
    from cli.main import main as cli_main
    from hub_standin import HubStandIn, point_hub_client_at, use_hub_cache

    use_hub_cache(tmp_path / "empty-cache", monkeypatch)
    recipe = str(REPO / "recipes" / "qwen3-0.6b-sft.yaml")
    for online in (False, True):
        with HubStandIn() as hub:
            if online:
                point_hub_client_at(hub, monkeypatch)
            code = cli_main(["plan", recipe, "--instance", "trn2.3xlarge", "--nproc", "4", "--runs-dir",
                             str(tmp_path / "runs")])
            assert hub.requests == []
        shown = capsys.readouterr()
        assert code == 0, shown.err
        assert "not checked here: model Qwen/Qwen3-0.6B and dataset trl-lib/Capybara" in shown.out
        assert "No shape forecast: model Qwen/Qwen3-0.6B and dataset trl-lib/Capybara not on this machine" in (
            shown.out)
        assert "STUDIO_NEURON_CORES=0-3" in shown.out and "Traceback" not in shown.out + shown.err


@pytest.mark.fast
def test_cli_plan_for_trainium_without_trainium(tmp_path):
    runs_dir = tmp_path / "runs"
    # --no-forecast: the forecast for a trn instance is test_forecast's part
    done = launch_py("plan", str(TINY), "--runs-dir", str(runs_dir), "--instance", "trn2.3xlarge",
                     "--set", "studio.nproc=4", "--no-forecast", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "STUDIO_NEURON_CORES=0-3" in done.stdout and "--nproc-per-node=4" in done.stdout
    assert "NEURON_RT_VISIBLE_CORES = 'rank 0: 0, rank 1: 1, rank 2: 2, rank 3: 3'" in done.stdout
    too_many = launch_py("plan", str(TINY), "--runs-dir", str(runs_dir), "--instance", "trn2.3xlarge",
                         "--set", "studio.nproc=8", timeout=60)
    assert too_many.returncode != 0
    assert "studio.nproc: 8 processes" in too_many.stdout + too_many.stderr
    assert "use at most 4" in too_many.stdout + too_many.stderr
    assert not runs_dir.exists() or run_folders(runs_dir) == []


# --- layering -----------------------------------------------------------------------------
IMPORT_ALL = """
import importlib, json, pkgutil, sys
import cli.main  # the command line's start-up: every command's parser
hub_client = sorted(m for m in ("huggingface_hub.hf_api", "httpx") if m in sys.modules)
import studio_core
names = [m.name for m in pkgutil.iter_modules(studio_core.__path__, "studio_core.")]
for name in names:
    importlib.import_module(name)
print(json.dumps([len(names), sorted(m for m in ("gradio", "torch", "trl") if m in sys.modules), hub_client]))
"""


@pytest.mark.fast
def test_studio_core_never_imports_gradio_or_the_training_stack():
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    count, loaded, hub_client = json.loads(done.stdout)
    assert count >= 11  # every module, the worker included
    assert loaded == []  # the web app's process stays light (see trl_schema.py)
    assert hub_client == []  # a command that does not reach the Hub starts without its client


@pytest.mark.fast
def test_run_ids_are_unique_across_runs_folders(tmp_path):
    # A run's processes are found machine-wide by their STUDIO_RUN_ID, so two runs of the same
    # name started in the same second in two runs folders must still get different ids.
    ids = {new_run_id(RunManager(tmp_path / f"runs{i}").runs_dir, "tiny-sft") for i in range(20)}
    assert len(ids) == 20


def test_relative_paths_are_made_absolute_for_the_worker(tmp_path, monkeypatch):
    # the worker runs in the run folder, so a dataset named relative to here must still be found
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "qa.jsonl").write_bytes((REPO / "studio_core" / "data" / "samples" / "qa.jsonl").read_bytes())
    manager = RunManager(tmp_path / "runs")
    view = manager.start(tiny("dataset_name=data/qa.jsonl", "max_steps=3"), cpu_hardware())
    assert view.spec["dataset_name"] == str(tmp_path / "data" / "qa.jsonl")
    assert manager.wait(view.id).state == "finished"


# --- core reservation -------------------------------------------------------------------
def test_a_run_holds_its_cores_until_nothing_of_it_is_left(manager):
    """A second run asking for a held core is refused; "next free" trains beside it (its events
    file deleted late in the run, and again after: it still reads finished); and when the
    first run's supervisor is killed (kill -9) its core is free only once its processes are."""
    first = manager.start(tiny(*LONG, "studio.cores=0"), cpu_hardware())
    wait_until_training(manager, first.id)
    rank0 = ranks(marked_processes(first.id))["0"]
    assert rank0.cpu_affinity() == [studio_cpus()[0]]  # pinned to the core it holds

    with pytest.raises(SpecError) as refused:
        manager.start(tiny("max_steps=3", "studio.cores=0"), cpu_hardware())
    assert f"core 0 is held by run {first.id}" in str(refused.value)
    assert [p.name for p in run_folders(manager.runs_dir)] == [first.id]  # nothing half-made

    # "next free": core 1; long enough that its progress (written a few steps at a time, at most
    # 0.25 s late) still comes after the deletion below
    second = manager.start(tiny("max_steps=300"), cpu_hardware())
    assert second.spec["studio"]["cores"] == "1"
    events_file = second.dir / "events.jsonl"
    manager.wait(second.id, lambda v: v.step >= 3 or v.live_state in FINAL_STATES)
    events_file.unlink()  # lost late in the run: what follows it still sees how it ends
    assert manager.wait(second.id).live_state == "finished"
    assert any("deleted or replaced while the run was going" in p for p in manager.view(second.id).damage())
    # the two trained side by side: the first went on training before, while and after the second
    def progress(run_id):
        return [e["time"] for e in read_events(manager.runs_dir / run_id / "events.jsonl") if e["type"] == "progress"]

    # progress is written a few steps at a time (up to 0.25 s late): wait for the first run's next lines
    manager.wait(first.id, lambda v: max(progress(first.id)) > max(progress(second.id)) or v.live_state in FINAL_STATES)
    assert manager.view(first.id).live_state == "running"
    (a_first, a_last), (b_first, b_last) = [(min(times), max(times)) for times in map(progress, (first.id, second.id))]
    assert a_first < b_first and b_last < a_last

    # the supervisor writes its final status, then ended.json, then exits: until then a new reader of a
    # missing events file sees a live run, so wait for that state (not for time) before deleting it again
    manager.wait(second.id, lambda v: not v.backend.alive(v.dir))
    events_file.unlink()  # lost after the end too: a new reader takes the ending from ended.json
    after = RunManager(manager.runs_dir).view(second.id)
    assert after.live_state == "finished" and after.error_text is None
    assert any("events.jsonl is missing" in problem for problem in after.damage())

    kill_the_supervisor_and_watch_its_processes_end(manager, first.id)
    assert 0 not in manager.core_holders(cpu_hardware())
    again = manager.start(tiny("studio.cores=0"), cpu_hardware())  # free once nothing of the first is left
    assert json.loads((again.dir / "launch.json").read_text())["cores"] == [0]
    manager.stop(again.id)


def kill_the_supervisor_and_watch_its_processes_end(manager: RunManager, run_id: str) -> None:
    """kill -9 the run's supervisor: torchrun, or a one-process run's worker (its parent-death
    signal), ends the ranks; until the
    last process of the run is gone its cores read held and the run is not shown as ended; then
    it reads failed, saying what happened, and nothing of it is left."""
    run_dir = manager.runs_dir / run_id
    procs = marked_processes(run_id)
    cores = json.loads((run_dir / "launch.json").read_text())["cores"]
    supervisor = procs.pop(json.loads((run_dir / "supervisor.json").read_text())["pid"])
    assert procs and ranks(procs)
    supervisor.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 60
    while any(still_there(p) for p in procs.values()):
        left = [p for p in procs.values() if running(p)]  # a zombie holds nothing: it waits to be reaped
        if left:
            live = manager.view(run_id)
            where = None if still_there(supervisor) else (live.where() or "")
            # the cores read after the view: held now, they were held when it looked
            held = leases.holders(manager.runs_dir, "cpu", max(cores) + 1)
            if not all(held.get(c, {}).get("holder") == run_id for c in cores):
                # the run's last process let go of them: it is exiting (the kernel closes its files
                # first), so it must be gone at once
                time.sleep(0.5)
                assert not [p for p in procs.values() if running(p)], f"cores free, {left} still there"
                continue
            assert live.live_state == "running", live.error_text  # not "failed" while its processes live
            assert where is None or "supervisor is gone" in where, where
        assert time.monotonic() < deadline, f"still there: {left}"
        time.sleep(0.02)
    view = manager.wait(run_id)
    assert view.live_state == "failed" and "no process of the run is left" in view.error_text
    assert marked_processes(run_id) == {}
    manager.stop(run_id)  # nothing left to stop: fine


def test_two_starts_in_the_same_moment_take_different_cores(manager):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        views = list(pool.map(lambda _: manager.start(tiny(*LONG), cpu_hardware()), range(2)))
    cores = [json.loads((v.dir / "launch.json").read_text())["cores"] for v in views]
    assert cores[0] != cores[1]
    for view in views:  # both were launched; stopped before they train, they leave nothing behind
        assert manager.stop(view.id).live_state == "stopped"
        assert marked_processes(view.id) == {}


def test_a_spec_is_checked_once_and_a_slow_check_holds_up_no_other_start(manager, tmp_path):
    """A spec is checked once, before the start lock. A reward file that takes its time to import
    (the check imports it in a child process before launch) must not keep another run from
    starting, and is imported by one check only, from the page or the CLI alike."""
    from concurrent.futures import ThreadPoolExecutor

    go_on, imports = tmp_path / "go-on", tmp_path / "imports.txt"
    slow = tmp_path / "slow_reward.py"
    slow.write_text("import os, time\n"
                    "run = os.environ.get('STUDIO_RUN_ID')  # set in a run's processes, not in a check\n"
                    f"with open({str(imports)!r}, 'a') as f:\n"
                    "    f.write((run or 'check') + '\\n')\n"
                    f"while run is None and not os.path.exists({str(go_on)!r}):  # held until the test says so\n"
                    "    time.sleep(0.05)\n"
                    "def reward(completions, **kwargs):\n"
                    "    return [0.0 for _ in completions]\n")
    grpo = RunSpec.load(REPO / "recipes" / "tiny-grpo.yaml").with_overrides(
        ["max_steps=3000", f"studio.rewards=[{{file: {slow}, function: reward}}]"])
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(manager.start, grpo, cpu_hardware())
        while not imports.exists():  # its check has begun
            time.sleep(0.05)
        try:
            quick = pool.submit(manager.start, tiny(*LONG), cpu_hardware()).result(timeout=120)
            assert not held.done(), "the slow check was over before the other start returned"
        finally:
            go_on.touch()
        slow_run = held.result(timeout=120)
    assert imports.read_text().splitlines().count("check") == 1
    for view in (quick, slow_run):
        assert manager.stop(view.id).live_state == "stopped"

    imports.unlink()
    recipe = tmp_path / "grpo.yaml"
    grpo.save(recipe)
    started = launch_py("train", str(recipe), "--detach", "--runs-dir", str(manager.runs_dir), "--backend", "cpu")
    assert started.returncode == 0, started.stderr
    assert imports.read_text().splitlines().count("check") == 1  # the CLI checks once too
    manager.stop(started.stdout.split()[1])
