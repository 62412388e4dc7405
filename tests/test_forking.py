"""Runs forked from a zygote (studio_core/backends/forking.py) keep every promise of a run started
as a new process: found by their marker, the worker the supervisor's child with the run's
environment (in /proc/PID/environ too), stop, leases; the zygote ends with its owner, its runs do
not. A process's environment replaced in place (studio_core/machine/own_environment.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from studio_core.machine import own_environment
from studio_core.machine.hardware import cpu_hardware
from studio_core.machine.procs import run_processes
from studio_core.rundir.events import FINAL_STATES, read as read_events
from studio_core.runs.manager import RunManager
from conftest import REPO, nothing_left

REPLACED = r"""
import ctypes, json, os, sys
from studio_core.machine import own_environment
new = json.loads(sys.argv[1])
try:
    own_environment.replace(new)
except ValueError as error:
    print(json.dumps({"error": str(error), "env": dict(os.environ)}), flush=True)
    sys.stdin.readline()
    sys.exit(0)
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
print(json.dumps({"getenv": {key: (libc.getenv(key.encode()) or b"").decode() for key in new},
                  "env": dict(os.environ)}), flush=True)
sys.stdin.readline()
"""


def replaced_in_a_child(started: dict, new: dict) -> tuple[dict, dict]:
    """What a child started with `started` says after replacing its environment with `new`, and what
    /proc/PID/environ (psutil) shows of it."""
    child = subprocess.Popen([sys.executable, "-c", REPLACED, json.dumps(new)], env=started, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        said = json.loads(child.stdout.readline())
        return said, psutil.Process(child.pid).environ()
    finally:
        child.communicate("\n", timeout=30)


@pytest.mark.fast
def test_a_new_environment_shows_in_proc_and_to_native_code_and_one_too_long_changes_nothing():
    base = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "STUDIO_RUN_ID": "zygote-of-1", "KEEP": "k",
            "LC_ALL": "C.UTF-8"}  # set: Python adds no LC_CTYPE of its own (PEP 538)
    new = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "STUDIO_RUN_ID": "20261207-000000-r-abc123",
           "OTHER": "é ü"}
    said, shown = replaced_in_a_child(own_environment.with_room(base), new)
    assert said["env"] == new and said["getenv"] == new  # Python's and the C library's
    assert {k: v for k, v in shown.items() if k != own_environment.ROOM} == new  # what the run's marker reads
    assert own_environment.fits(own_environment.with_room(base), new)
    too_long = {**new, "OTHER": "x" * (own_environment.ROOM_BYTES + 100)}
    assert not own_environment.fits(own_environment.with_room(base), too_long)
    said, shown = replaced_in_a_child(own_environment.with_room(base), too_long)
    assert "needs" in said["error"] and said["env"] == own_environment.with_room(base)
    assert shown == own_environment.with_room(base)


OWNER = r"""
import json, os, sys
from studio_core.backends import forking
from studio_core.machine.hardware import cpu_hardware
from studio_core.recipe.spec import RunSpec
from studio_core.runs.manager import RunManager
RunManager.fork_runs_from_a_zygote()
manager = RunManager(sys.argv[1])
tiny = lambda *more: RunSpec.load(sys.argv[2]).with_overrides(["max_steps=2", "logging_steps=1", *more])
first = manager.wait(manager.start(tiny(), cpu_hardware()).id)
assert forking.ready(120), "the zygote did not import within 120 s"
second = manager.wait(manager.start(tiny("run_name=second"), cpu_hardware()).id)
os.environ["STUDIO_TEST_OTHER"] = "1"  # a variable a library could read: these runs are not forked
other = manager.wait(manager.start(tiny("run_name=other"), cpu_hardware()).id)  # the zygote is kept
again = manager.wait(manager.start(tiny("run_name=again"), cpu_hardware()).id)  # a zygote of this environment
assert forking.ready(120), "the new zygote did not import within 120 s"
long = manager.start(tiny("run_name=long", "max_steps=3000", "logging_steps=50"), cpu_hardware())
print(json.dumps({"finished": [first.id, second.id, other.id, again.id], "long": long.id}), flush=True)
sys.stdin.readline()  # then this owner ends: its zygote ends, its runs go on
"""


def worker_log_says(runs: Path, run_id: str, text: str) -> bool:
    return any(text in e.get("message", "") for e in read_events(runs / run_id / "events.jsonl") if e["type"] == "log")


def first_loss(runs: Path, run_id: str) -> float:
    return next(e["loss"] for e in read_events(runs / run_id / "events.jsonl") if e["type"] == "metrics" and "loss" in e)


def test_runs_forked_from_the_zygote_are_runs_in_every_way_and_outlive_its_owner(tmp_path):
    runs = tmp_path / "runs"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(runs), str(REPO / "recipes" / "tiny-sft.yaml")],
                             cwd=REPO, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        started = json.loads(owner.stdout.readline() or "{}")
        assert started, f"the owner ended: {owner.wait()}"
        manager = RunManager(runs)
        views = [manager.view(run_id) for run_id in started["finished"]]
        assert [view.state for view in views] == ["finished"] * 4, [view.error_text for view in views]
        forked = "forked from the studio's zygote"
        assert [worker_log_says(runs, view.id, forked) for view in views] == [False, True, False, False]
        first, second = views[:2]
        assert first_loss(runs, first.id) == pytest.approx(first_loss(runs, second.id))  # the same first step
        assert "FutureWarning" in (runs / second.id / "train.log").read_text()  # the imports' output, as a start's

        long_id = started["long"]
        view = manager.wait(long_id, lambda v: v.step >= 5 or v.live_state in FINAL_STATES)
        assert view.live_state == "running" and worker_log_says(runs, long_id, forked), view.error_text
        zygote = next(p for p in psutil.Process(owner.pid).children() if "studio_core.training.zygote" in p.cmdline())
        procs = {p.pid: p for p in run_processes(long_id)}
        supervisor = psutil.Process(json.loads((runs / long_id / "supervisor.json").read_text())["pid"])
        (worker,) = [p for p in procs.values() if p.pid != supervisor.pid]
        assert supervisor.pid in procs and supervisor.ppid() == zygote.pid and worker.ppid() == supervisor.pid
        assert os.getsid(supervisor.pid) == supervisor.pid != os.getsid(owner.pid)  # a session of its own
        env = worker.environ()
        assert env["STUDIO_RUN_ID"] == long_id and env["WORLD_SIZE"] == "1" and int(env["MASTER_PORT"]) > 0
        assert "STUDIO_TEST_OTHER" in env and supervisor.environ()["STUDIO_RUN_ID"] == long_id
        assert set(worker.cpu_affinity()) <= set(supervisor.cpu_affinity())

        owner.communicate("\n", timeout=60)  # the owner ends: so does its zygote, not its run
        assert psutil.wait_procs([zygote], timeout=30)[1] == []
        assert manager.view(long_id).live_state == "running" and worker.is_running()
        supervisor.kill()  # without its supervisor, the worker still holds the cores, then dies with it
        assert psutil.wait_procs([worker], timeout=30)[1] == []
        nothing_left(long_id)
        assert manager.wait(long_id).live_state == "failed"
    finally:
        if owner.poll() is None:
            owner.kill()


BROKEN_ZYGOTE = r"""
import json, sys
from studio_core.backends import forking
from studio_core.machine.hardware import cpu_hardware
from studio_core.recipe.spec import RunSpec
from studio_core.runs.manager import RunManager
RunManager.fork_runs_from_a_zygote()
manager = RunManager(sys.argv[1])
tiny = lambda name: RunSpec.load(sys.argv[2]).with_overrides(["max_steps=1", f"run_name={name}"])
first = manager.wait(manager.start(tiny("first"), cpu_hardware()).id)
assert forking.ready(120), "the zygote did not import within 120 s"
forking._owner.zygote.kill()  # as the OOM killer or a user might
forking._owner.zygote.wait()
second = manager.wait(manager.start(tiny("second"), cpu_hardware()).id)
third = manager.wait(manager.start(tiny("third"), cpu_hardware()).id)
print(json.dumps({"runs": [first.id, second.id, third.id], "states": [first.state, second.state, third.state],
                  "zygote": forking.ready()}), flush=True)
"""


def test_a_zygote_that_ended_by_itself_is_not_started_again_and_runs_start_as_new_processes(tmp_path):
    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-c", BROKEN_ZYGOTE, str(runs), str(REPO / "recipes" / "tiny-sft.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["states"] == ["finished"] * 3 and said["zygote"] is False
    assert not any(worker_log_says(runs, run_id, "forked from the studio's zygote") for run_id in said["runs"])
