"""Where core leases live: one folder per machine whatever the runs folder (default under the
studio's cache, per host), STUDIO_LEASES_DIR to choose it, and the runs folder's old `.leases/`,
where a run of an older studio may still hold its cores, honoured.

Holders are `python -c` children, killed by pid at the end of each test. The test suite keeps
each runs folder's leases apart (conftest: STUDIO_LEASES_DIR=.leases); these tests set their own.
"""

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from studio_core.machine import leases
from studio_core.machine.hardware import Hardware

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

REPO = Path(__file__).resolve().parents[1]
RUN_A, RUN_B = "20261129-120000-sft-aaaaaa", "20261129-130000-sft-bbbbbb"
GPUS = Hardware("cuda", 2, cpu_count=2)  # choose() on a backend that asks no tool about other programs

HOLDER = """
import sys, time
from studio_core.machine.leases import acquire
runs_dir, backend, core, holder = sys.argv[1:5]
lease = acquire(runs_dir, backend, [int(core)], holder, "run")
print("ready", flush=True)
time.sleep(120)
"""

# What an older studio's run supervisor did to hold a core: lock <runs dir>/.leases/<backend>-core-<n>.lock
# and write who it is into it (the lease code before leases were machine-wide).
OLDER_STUDIO = """
import fcntl, json, os, sys, time
runs_dir, backend, core, holder = sys.argv[1:5]
os.makedirs(os.path.join(runs_dir, ".leases"), exist_ok=True)
fd = os.open(os.path.join(runs_dir, ".leases", f"{backend}-core-{core}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.pwrite(fd, json.dumps({"holder": holder, "kind": "run", "pid": os.getpid(), "time": time.time()}).encode(), 0)
print("ready", flush=True)
time.sleep(120)
"""


def assert_locked(path) -> None:
    """Another open file of `path` cannot take its lock: someone holds it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


@pytest.fixture
def spawn():
    """Start a holder (`script` with runs folder, backend, core and holder); returns its process."""
    started = []

    def start(script, runs_dir, core, holder, backend="cuda"):
        proc = subprocess.Popen([sys.executable, "-c", script, str(runs_dir), backend, str(core), holder], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(proc)
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            pytest.fail(f"holder did not start: {proc.communicate()[1]}")
        return proc

    yield start
    for proc in started:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


def test_two_runs_folders_contend_for_one_core_in_the_machine_wide_default(tmp_path, monkeypatch, spawn):
    monkeypatch.delenv(leases.LEASES_ENV, raising=False)  # the default, under this test's own studio cache
    monkeypatch.setenv("STUDIO_CACHE_DIR", str(tmp_path / "cache"))
    ours, theirs = tmp_path / "runs", tmp_path / "other-runs"  # e.g. the app's, and a CLI run's --runs-dir
    holder = spawn(HOLDER, theirs, 0, RUN_A)
    with pytest.raises(leases.CoresBusy, match=f"core 0 is held by run {RUN_A} \\(pid {holder.pid}\\)"):
        leases.acquire(ours, "cuda", [0], RUN_B, "run")
    assert leases.holders(ours, "cuda", 2)[0]["pid"] == holder.pid
    assert leases.choose(ours, GPUS, 1, None) == [1]  # "next free" skips the other folder's run
    assert leases.has_free(ours, GPUS, 1) and not leases.has_free(ours, GPUS, 2)
    machine = tmp_path / "cache" / "leases" / socket.gethostname()
    assert json.loads((machine / "cuda-core-0.lock").read_text())["holder"] == RUN_A
    assert not (theirs / ".leases").exists() and not (ours / ".leases").exists()  # nothing in the runs folders
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    assert leases.free_cores(ours, "cuda", 2) == {0, 1}


def test_a_core_an_older_studio_holds_in_the_runs_folder_counts_as_held(tmp_path, monkeypatch, spawn):
    monkeypatch.setenv(leases.LEASES_ENV, str(tmp_path / "machine"))
    runs = tmp_path / "runs"
    older = spawn(OLDER_STUDIO, runs, 0, RUN_A)  # a run an older studio started before the upgrade
    held = leases.holders(runs, "cuda", 2)
    assert set(held) == {0} and (held[0]["holder"], held[0]["pid"]) == (RUN_A, older.pid)
    with pytest.raises(leases.CoresBusy, match=f"core 0 is held by run {RUN_A} \\(pid {older.pid}\\)"):
        leases.acquire(runs, "cuda", [0, 1], RUN_B, "run")
    assert leases.choose(runs, GPUS, 1, None) == [1]
    with leases.acquire(runs, "cuda", [1], RUN_B, "run") as lease:
        # held in this machine's folder, and in the old one too, where an older studio looks
        assert json.loads((tmp_path / "machine" / "cuda-core-1.lock").read_text())["holder"] == RUN_B
        assert_locked(runs / ".leases" / "cuda-core-1.lock")
        assert len(lease.descriptors()) == 2  # a run's torchrun gets both
    with leases.choosing(runs):  # the older studio's chooser lock is taken too
        assert_locked(runs / ".leases" / "choosing.lock")
    older.send_signal(signal.SIGKILL)
    older.wait(timeout=10)
    assert leases.free_cores(runs, "cuda", 2) == {0, 1}  # its core is free once it has ended


def test_STUDIO_LEASES_DIR_chooses_the_folder_and_a_relative_one_is_per_runs_folder(tmp_path, monkeypatch, spawn):
    one, two = tmp_path / "one", tmp_path / "two"
    monkeypatch.setenv(leases.LEASES_ENV, str(tmp_path / "shared"))
    holder = spawn(HOLDER, one, 1, RUN_A)  # the child reads the same setting
    assert leases.lock_path(two, "cuda", 1) == tmp_path / "shared" / "cuda-core-1.lock"
    assert leases.holders(two, "cuda", 2)[1]["pid"] == holder.pid
    monkeypatch.setenv(leases.LEASES_ENV, ".leases")  # inside each runs folder: one and two apart
    assert leases.lock_path(two, "cuda", 1) == two / ".leases" / "cuda-core-1.lock"
    with leases.acquire(one, "cuda", [0], RUN_A, "run"), leases.acquire(two, "cuda", [0], RUN_B, "run"):
        assert leases.holders(two, "cuda", 2)[0]["holder"] == RUN_B
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(leases.LEASES_ENV, str(tmp_path / "a-file" / "leases"))
    with pytest.raises(leases.LeaseFolderError, match=f"set {leases.LEASES_ENV} to a folder you can write to"):
        leases.acquire(one, "cuda", [0], RUN_A, "run")
    with pytest.raises(leases.LeaseFolderError, match=str(tmp_path / "a-file" / "leases")):
        with leases.choosing(one):
            pass
    assert leases.holders(one, "cuda", 2) == {}  # a probe finds nothing held there, and does not fail
