"""Core leases between real processes: a child holds cores, this test process asks for them.

Holders are `python -c` children that acquire a lease, print "ready", and sleep; they are
killed by pid at the end of each test, so a failing test leaves nothing behind.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from studio_core.machine.leases import CoresBusy, acquire, free_cores, holders, lock_path

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

REPO = Path(__file__).resolve().parents[1]
RUN_A, RUN_B, RUN_C = (f"20261129-120000-sft-{c * 6}" for c in "abc")

HOLDER = """
import subprocess, sys, time
from studio_core.machine.leases import acquire
runs_dir, backend, cores, holder, kind, child = sys.argv[1:7]
lease = acquire(runs_dir, backend, [int(c) for c in cores.split(",")], holder, kind)
# close_fds=False: only the descriptors' own close-on-exec flag keeps the lock from the child
extra = {"pass_fds": list(lease.descriptors())} if child == "inherit" else {"close_fds": False}
if child != "none":  # a long-lived child, as torchrun is to the supervisor
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], **extra)
    print("child", kid.pid, flush=True)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture
def spawn(tmp_path):
    """Start a holder process; returns (process, pid of its own child or None)."""
    started: list[int] = []

    def start(cores, holder, kind="run", backend="neuron", child="none"):
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(tmp_path), backend, ",".join(map(str, cores)), holder, kind, child],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(proc.pid)
        kid = None
        line = proc.stdout.readline()
        if line.startswith("child"):
            kid = int(line.split()[1])
            started.append(kid)
            line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.kill()
            pytest.fail(f"holder did not start: {proc.communicate()[1]}")
        return proc, kid

    yield start
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue  # already gone: the test killed it
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            continue  # a grandchild, reaped by init once its parent died


def kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_lease_held_by_another_process_refuses_and_names_it(tmp_path, spawn):
    proc, _ = spawn([3], "20261129-120000-abc123")
    with pytest.raises(CoresBusy) as err:
        acquire(tmp_path, "neuron", [3], "20261129-130000-def456", "run")
    message = str(err.value)
    assert f"core 3 is held by run 20261129-120000-abc123 (pid {proc.pid})" in message
    assert "Pick other cores" in message and "stop the run" in message
    assert err.value.busy[3]["holder"] == "20261129-120000-abc123"
    assert isinstance(err.value, ValueError)


def test_disjoint_leases_coexist(tmp_path, spawn):
    spawn([0, 1], RUN_A)
    with acquire(tmp_path, "neuron", [2, 3], RUN_B, "run") as lease:
        assert lease.cores == [2, 3]
        assert set(holders(tmp_path, "neuron", 4)) == {0, 1, 2, 3}
    assert free_cores(tmp_path, "neuron", 4) == {2, 3}


def test_partly_busy_request_takes_nothing(tmp_path, spawn):
    spawn([2], RUN_A)
    with pytest.raises(CoresBusy) as err:
        acquire(tmp_path, "neuron", [1, 2, 3], RUN_B, "run")
    assert set(err.value.busy) == {2}
    assert "core 1" not in str(err.value) and "core 3" not in str(err.value)
    assert free_cores(tmp_path, "neuron", 4) == {0, 1, 3}  # 1 and 3 were given back
    acquire(tmp_path, "neuron", [1, 3], RUN_C, "run").release()


def test_every_busy_core_is_named(tmp_path, spawn):
    spawn([0], RUN_A)
    chat, _ = spawn([1], "chat-7f3a", kind="chat")
    with pytest.raises(CoresBusy) as err:
        acquire(tmp_path, "neuron", [0, 1, 2], RUN_B, "run")
    assert f"core 0 is held by run {RUN_A}" in str(err.value)
    assert f"core 1 is held by chat-7f3a (pid {chat.pid})" in str(err.value)


def test_sigkilled_holder_frees_its_cores_at_once(tmp_path, spawn):
    proc, _ = spawn([0, 1], RUN_A)
    assert free_cores(tmp_path, "neuron", 2) == set()
    kill(proc)
    assert free_cores(tmp_path, "neuron", 2) == {0, 1}
    acquire(tmp_path, "neuron", [0, 1], RUN_B, "run").release()


def test_stale_file_of_dead_holder_is_free(tmp_path):
    path = lock_path(tmp_path, "neuron", 5)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"holder": "20261128-000000-old-dead00", "kind": "run", "pid": 999999, "time": 0}))
    assert holders(tmp_path, "neuron", 8) == {}
    with acquire(tmp_path, "neuron", [5], RUN_C, "run"):
        assert json.loads(path.read_text())["holder"] == RUN_C
        assert holders(tmp_path, "neuron", 8)[5]["holder"] == RUN_C


def test_holders_report_who_holds_what(tmp_path, spawn):
    run, _ = spawn([0, 1], "20261129-120000-abc123")
    chat, _ = spawn([3], "chat-42", kind="chat", backend="cuda")
    assert holders(tmp_path, "cpu", 4) == {}
    neuron = holders(tmp_path, "neuron", 4)
    assert set(neuron) == {0, 1}
    assert neuron[0]["holder"] == "20261129-120000-abc123" and neuron[0]["kind"] == "run"
    assert neuron[0]["pid"] == run.pid
    cuda = holders(tmp_path, "cuda", 4)
    assert set(cuda) == {3} and cuda[3]["holder"] == "chat-42" and cuda[3]["pid"] == chat.pid
    assert free_cores(tmp_path, "neuron", 4) == {2, 3}


def test_child_of_holder_does_not_keep_the_lock(tmp_path, spawn):
    proc, kid = spawn([0], RUN_A, child="plain")
    kill(proc)
    assert alive(kid), "the holder's child should outlive it for this test to mean anything"
    assert free_cores(tmp_path, "neuron", 1) == {0}
    acquire(tmp_path, "neuron", [0], RUN_B, "run").release()


def test_child_given_the_descriptor_does_keep_the_lock(tmp_path, spawn):
    # The control for the test above: the same setup, but the child is handed the
    # lock's descriptor on purpose, and then the lock does outlive the holder.
    proc, kid = spawn([0], RUN_A, child="inherit")
    kill(proc)
    assert alive(kid)
    with pytest.raises(CoresBusy, match=f"core 0 is held by run {RUN_A}"):
        acquire(tmp_path, "neuron", [0], RUN_B, "run")
    os.kill(kid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(kid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert free_cores(tmp_path, "neuron", 1) == {0}


def test_release_and_context_manager_in_one_process(tmp_path):
    lease = acquire(tmp_path, "cpu", [0, 1], "chat-1", "chat")
    with pytest.raises(CoresBusy, match="core 1 is held by chat-1"):  # even this process can't take it twice
        acquire(tmp_path, "cpu", [1], "chat-2", "chat")
    lease.release()
    lease.release()
    assert free_cores(tmp_path, "cpu", 2) == {0, 1}
    assert lock_path(tmp_path, "cpu", 0).read_text() == ""  # a released file names nobody
    with acquire(tmp_path, "cpu", [1], "export-1", "export") as lease:
        assert holders(tmp_path, "cpu", 2)[1]["kind"] == "export"
    assert lease.fds == {}
    assert free_cores(tmp_path, "cpu", 2) == {0, 1}


def test_lease_descriptors_are_not_inheritable(tmp_path):
    with acquire(tmp_path, "neuron", [0, 1], RUN_A, "run") as lease:
        assert all(not os.get_inheritable(fd) for fd in lease.fds.values())


@pytest.mark.parametrize("backend, cores, kind, fix", [
    ("tpu", [0], "run", "use one of neuron, cuda, cpu"),
    ("neuron", [0], "train", "use one of run, chat, serve, eval, export"),
    ("neuron", [-1], "run", "whole numbers from 0 up"),
    ("neuron", [], "run", "at least one core"),
])
def test_bad_requests_say_what_to_change(tmp_path, backend, cores, kind, fix):
    with pytest.raises(ValueError, match=fix):
        acquire(tmp_path, backend, cores, RUN_A, kind)


def test_core_map_probes_never_make_a_start_fail(tmp_path):
    # The UI polls holders() all the time; its brief try-locks must not look like a holder.
    prober = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom studio_core.machine.leases import holders\n"
         "print('ready', flush=True)\nwhile True: holders(sys.argv[1], 'neuron', 4)", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert prober.stdout.readline().strip() == "ready"
        for _ in range(300):
            acquire(tmp_path, "neuron", [0, 1, 2, 3], RUN_A, "run").release()
    finally:
        kill(prober)


def test_a_preview_on_this_machine_shows_the_cores_start_would_take(tmp_path, spawn):
    """The plan of a launch here and now: next free cores (and their thread count on CPU), and
    held cores refused naming the holder, as Start would; for another instance, none of that."""
    from studio_core.machine.hardware import Hardware, instance_hardware
    from studio_core.runs.manager import RunManager
    from studio_core.recipe.spec import RunSpec, SpecError

    spawn([0], RUN_A, backend="cpu")
    manager, cpu = RunManager(tmp_path), Hardware(backend="cpu", devices=2, cpu_count=2)
    spec = RunSpec.load(REPO / "recipes" / "tiny-sft.yaml")
    launch = manager.plan(spec, cpu, this_machine=True)
    assert launch.spec.layout.cores == "1" and launch.env["OMP_NUM_THREADS"] == "1"
    assert launch.applied[0][:2] == ("studio.cores", "1")
    with pytest.raises(SpecError, match=f"core 0 is held by run {RUN_A}"):
        manager.plan(spec.with_overrides(["studio.cores='0'"]), cpu, this_machine=True)
    elsewhere = manager.plan(spec, instance_hardware("trn2.3xlarge"))  # leases here say nothing there
    assert elsewhere.env["NEURON_RT_VISIBLE_CORES"] == "0" and "studio.cores" not in dict(
        (key, value) for key, value, _ in elsewhere.applied)


def test_a_lease_folder_that_is_a_file_is_named_with_what_to_do(tmp_path):
    """Issue 47: the runs folder's `.leases` (the lease folder here: conftest's relative
    STUDIO_LEASES_DIR) is a file: a start's lease and a chooser each say which file is in the way and
    what to do (they said only "File exists"); a probe finds nothing held, and the file is left as it is."""
    from studio_core.machine.leases import LEASES_ENV, LeaseFolderError, choosing

    (tmp_path / ".leases").write_text("not a folder")
    fix = (f"the core lease folder {tmp_path / '.leases'} cannot be made: {tmp_path / '.leases'} is a file, not a "
           f"folder: move it away, or set {LEASES_ENV} to a folder you can write to")
    for attempt in (lambda: acquire(tmp_path, "cpu", [0], RUN_A, "run"), lambda: choosing(tmp_path).__enter__()):
        with pytest.raises(LeaseFolderError) as refused:
            attempt()
        assert str(refused.value) == fix
    assert holders(tmp_path, "cpu", 2) == {} and (tmp_path / ".leases").read_text() == "not a folder"
