"""The queue of local runs: a run whose cores are busy waits in order instead of being refused,
can be moved or cancelled, starts when its cores free up (its queue runner a real detached
process), survives its runner being killed (as by a reboot), and is never started twice by two
starters at once. Real runs of the tiny model on this machine's CPU; the cores are held by a
lease taken here, as a chat's process holds one."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from conftest import launch_py
from studio_core.machine import leases
from studio_core.machine.procs import run_processes
from studio_core.machine.hardware import cpu_hardware
from studio_core.rundir import events
from studio_core.rundir.events import fold
from studio_core.runs import queue
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import SpecError
from test_runs import REPO, tiny

HOLDER = "chat-holding-both"
T0 = 1_767_000_000.0  # the first start of the event streams written here


@pytest.fixture
def held(manager):
    """Both CPU cores of the runs folder held here, as a chat's process holds one; given back at
    the end if the test did not. Queued runs left are cancelled, so their runner exits."""
    lease = leases.acquire(manager.runs_dir, "cpu", [0, 1], holder=HOLDER, kind="chat")
    yield lease
    lease.release()
    for path in queue.queued(manager.runs_dir):
        queue.cancel(manager.runs_dir, path.name)
    wait_for(lambda: not runners(manager.runs_dir), "the queue runner to exit")


def runners(runs_dir) -> list[psutil.Process]:
    """The live queue runners of this runs folder."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "studio_core.runs.queue_runner" in cmdline and str(runs_dir) in cmdline:
            found.append(proc)
    return [proc for proc in found if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE]


def wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.2)


def started_at(view) -> float:
    """When the run left the queue: the time of its `status starting` event."""
    return next(e["time"] for e in events.read(view.dir / "events.jsonl")
                if e["type"] == "status" and e.get("state") == "starting")


def test_busy_cores_queue_runs_in_order_moved_and_cancelled_then_each_starts_when_its_cores_free(manager, held):
    hardware = cpu_hardware()
    two = ["studio.nproc=2", "max_steps=3"]  # each needs both cores: one runs at a time
    first = manager.start(tiny(*two), hardware, queue_if_busy=True)
    second = manager.start(tiny(*two), hardware, queue_if_busy=True)
    third = manager.start(tiny(*two), hardware, queue_if_busy=True)
    assert [v.live_state for v in (first, second, third)] == ["queued"] * 3
    assert first.where().startswith("queued, 1st of 3: waits for 2 free cpu core(s)") and HOLDER in first.where()
    assert second.where() == f"queued, 2nd of 3: after run {first.id}"
    assert first.training_seconds() is None and len(runners(manager.runs_dir)) == 1  # no attempt yet; one runner

    queue.move(manager.runs_dir, third.id, 1)
    assert [p.name for p in queue.queued(manager.runs_dir)] == [third.id, first.id, second.id]
    cancelled = manager.stop(second.id)
    assert cancelled.live_state == "stopped" and cancelled.error_text == queue.CANCELLED
    with pytest.raises(queue.QueueError, match="is not queued"):
        queue.move(manager.runs_dir, second.id, 1)
    refused = launch_py("train", "recipes/tiny-sft.yaml", "--no-queue", "--runs-dir", str(manager.runs_dir))
    assert refused.returncode == 2 and f"held ({HOLDER}" in refused.stderr and "queue the run" in refused.stderr
    listed = launch_py("queue", "--runs-dir", str(manager.runs_dir))
    assert listed.stdout.splitlines()[0].startswith(f"{third.id} ") and "1st of 2" in listed.stdout
    runs = launch_py("runs", "--runs-dir", str(manager.runs_dir)).stdout  # each queued run's place (queue read once)
    assert "[queued, 1st of 2: waits for 2 free cpu core(s)" in runs
    assert f"[queued, 2nd of 2: after run {third.id}]" in runs

    held.release()  # the runner starts them in their order, one at a time: each needs both cores
    third, first = manager.wait(third.id), manager.wait(first.id)
    assert (third.live_state, first.live_state) == ("finished", "finished"), (third.error_text, first.error_text)
    assert started_at(third) < started_at(first)
    assert started_at(first) >= third.spans[-1].end - 1  # it waited for the cores the one before it held
    assert first.training_seconds() < time.time() - first.launch()["created"]  # its wait is no training time
    wait_for(lambda: not runners(manager.runs_dir), "the runner to exit with the queue empty")


def test_a_sweeps_hold_keeps_a_run_queued_on_free_cores_until_the_run_it_shares_a_precompile_with_allows(
        manager, held):
    hardware = cpu_hardware()
    # the leader runs long enough to be seen running (a 3-step run may end within one look)
    leader = manager.start(tiny("max_steps=40"), hardware, queue_if_busy=True)
    follower = manager.start(tiny("max_steps=3"), hardware, queue_if_busy=True, hold={"after": leader.id})
    assert queue.hold_of(follower.dir) == {"after": leader.id}
    queue.move(manager.runs_dir, follower.id, 1)  # a move keeps the hold
    queue.move(manager.runs_dir, leader.id, 1)
    assert queue.hold_of(follower.dir) == {"after": leader.id}
    held.release()  # two free cores, one run each: the follower still waits for its leader
    wait_for(lambda: manager.view(leader.id).live_state == "running", "the leader to run")
    paused = run_processes(leader.id)  # paused while we look: it cannot end between two looks
    for proc in paused:
        proc.suspend()
    try:
        assert manager.view(leader.id).live_state == "running"
        assert manager.view(follower.id).live_state == "queued"
        assert f"waits for run {leader.id} to precompile the shapes this run shares with it" in follower.where()
    finally:
        for proc in paused:
            proc.resume()
    # the leader has no precompile: it ends before the follower goes (which then compiles what it must)
    leader, follower = manager.wait(leader.id), manager.wait(follower.id)
    assert (leader.live_state, follower.live_state) == ("finished", "finished"), follower.error_text
    assert started_at(follower) >= leader.spans[-1].end - 1
    wait_for(lambda: not runners(manager.runs_dir), "the runner to exit with the queue empty")


def test_a_killed_runner_leaves_the_queue_on_disk_and_the_next_look_starts_it_again(manager, held):
    run = manager.start(tiny("max_steps=3"), cpu_hardware(), queue_if_busy=True)
    (runner,) = runners(manager.runs_dir)
    runner.kill()  # as a reboot would: nothing is left to start the run
    runner.wait(10)
    held.release()
    time.sleep(3 * queue.QUEUE_POLL_S)
    assert manager.view(run.id).live_state == "queued"  # no runner: it waits
    listed = launch_py("runs", "--runs-dir", str(manager.runs_dir))  # a look at the runs folder starts one
    assert listed.returncode == 0 and run.id in listed.stdout
    assert manager.wait(run.id).live_state == "finished"


def killed_runner_and_free_cores(manager, held) -> str:
    """A run queued, its runner killed (as by SIGKILL or a reboot), then its cores freed: nothing
    starts it until something looks. Its id."""
    run = manager.start(tiny("max_steps=3"), cpu_hardware(), queue_if_busy=True)
    (runner,) = runners(manager.runs_dir)
    runner.kill()
    runner.wait(10)
    held.release()
    time.sleep(3 * queue.QUEUE_POLL_S)
    assert manager.view(run.id).live_state == "queued" and not runners(manager.runs_dir)  # no runner: it waits
    return run.id


def started_by_a_new_runner(manager, run_id: str) -> bool:
    """Whether a queue runner started the run (its log says so; the killed one never could: the
    cores were held while it lived). The new runner may have ended already: it exits once nothing
    is queued, a second after starting the run when the config check's verdict was kept."""
    return f"run {run_id}: started" in (manager.runs_dir / queue.LOG).read_text()


def test_a_killed_runner_is_replaced_by_the_next_start(manager, held):
    """Issue 47: a start on free cores looks after the queue too (only a queued start did)."""
    waiting = killed_runner_and_free_cores(manager, held)
    started = manager.start(tiny("max_steps=3"), cpu_hardware())  # its core is free: it starts at once
    assert started.live_state != "queued" and len(runners(manager.runs_dir)) <= 1
    wait_for(lambda: started_by_a_new_runner(manager, waiting), "a new queue runner to start the queued run")
    assert manager.wait(waiting).live_state == "finished"
    assert manager.wait(started.id).live_state == "finished"


def test_a_killed_runner_is_replaced_by_the_runs_tabs_refresh(manager, held):
    """Issue 47: the Runs tab's refresh (its listing, also on the page's timer) looks after the queue
    as `launch.py runs` does: both list the runs through RunManager.list."""
    import gradio as gr

    from app import runs_tab

    with gr.Blocks() as page:
        runs_tab.build(manager, page, cpu_hardware())
    [refresh] = {f.fn for f in page.fns.values() if getattr(f.fn, "__name__", "") == "on_refresh"}  # one, wired often
    waiting = killed_runner_and_free_cores(manager, held)
    table = refresh(None, runs_tab.ALL, runs_tab.ALL, runs_tab.ALL, "newest first")[0]
    assert list(table["run"]) == [waiting] and len(runners(manager.runs_dir)) <= 1
    wait_for(lambda: started_by_a_new_runner(manager, waiting), "a new queue runner to start the queued run")
    assert manager.wait(waiting).live_state == "finished"


def test_a_run_cancelled_while_queued_has_no_start_and_no_times(manager, held):
    """Issue 47: its cancel is no start (the runs listing showed the cancel's time as its start)."""
    run = manager.start(tiny("max_steps=3"), cpu_hardware(), queue_if_busy=True)
    time.sleep(1.5)  # the cancel's time is not the time the run was queued
    cancelled = manager.stop(run.id)
    assert cancelled.live_state == "stopped" and cancelled.error_text == queue.CANCELLED
    assert (cancelled.first_start, cancelled.training_seconds(), cancelled.wall_seconds()) == (None, None, None)
    assert cancelled.created == cancelled.launch()["created"]  # listed by when it was made, as while it waited
    (row,) = [line for line in launch_py("runs", "--runs-dir", str(manager.runs_dir)).stdout.splitlines()
              if line.startswith(run.id)]
    assert row.split()[1] == "stopped" and row.split()[3:6] == ["-", "-", "-"], row  # started, training, wall


def test_a_damaged_place_in_the_queue_is_named_and_skipped_and_the_others_start(manager, held):
    hardware = cpu_hardware()
    damaged = manager.start(tiny("max_steps=3"), hardware, queue_if_busy=True)
    good = manager.start(tiny("max_steps=3"), hardware, queue_if_busy=True)
    (damaged.dir / queue.QUEUE).write_text('{"order": "x"}')
    for command in ("runs", "queue"):
        listed = launch_py(command, "--runs-dir", str(manager.runs_dir))
        assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
        assert good.id in listed.stdout and "its place cannot be read (queue.json is damaged)" in listed.stdout
        assert f"launch.py stop {damaged.id}" in listed.stdout
    held.release()
    assert manager.wait(good.id).live_state == "finished"  # the runner went past the damaged one
    assert manager.view(damaged.id).live_state == "queued"  # never started by itself
    stopped = launch_py("stop", damaged.id, "--runs-dir", str(manager.runs_dir))
    assert stopped.returncode == 0 and "cancelled while queued" in stopped.stdout, stopped.stderr
    wait_for(lambda: not runners(manager.runs_dir), "the runner to exit with the queue empty")


def test_starters_racing_for_one_queued_run_start_it_once(manager, held):
    run = manager.start(tiny("max_steps=3"), cpu_hardware(), queue_if_busy=True)
    starter = [sys.executable, "-c", "import sys; from studio_core.runs.manager import RunManager; "
               "print(RunManager(sys.argv[1]).start_queued())", str(manager.runs_dir)]
    extra_runner = [sys.executable, "-m", "studio_core.runs.queue_runner", str(manager.runs_dir)]
    held.release()
    racers = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for argv in (starter, starter, extra_runner)]
    outputs = [racer.communicate(timeout=120) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0, 0], outputs
    assert manager.wait(run.id).live_state == "finished"
    statuses = [e["state"] for e in events.read(run.dir / "events.jsonl") if e["type"] == "status"]
    assert statuses.count("starting") == 1 and statuses[0] == "queued", statuses


def test_a_resume_whose_cores_are_busy_waits_in_the_queue_and_a_cancel_leaves_the_run_as_it_was(manager):
    hardware = cpu_hardware()
    run = manager.start(tiny("max_steps=6", "save_strategy=steps", "save_steps=6"), hardware)
    manager.stop_and_save(run.id)  # asked before training begins: a checkpoint at step 1, then a stop
    stopped = manager.wait(run.id)
    assert stopped.live_state == "stopped" and [c["step"] for c in stopped.checkpoints] == [1]
    before = (stopped.live_state, stopped.reason, stopped.ended, stopped.training_seconds(), stopped.attempts)
    lease = leases.acquire(manager.runs_dir, "cpu", [0, 1], holder=HOLDER, kind="chat")
    try:
        with pytest.raises(SpecError, match=f"held \\({HOLDER}"):  # without the queue: refused, as before
            manager.resume(run.id, hardware)
        queued = launch_py("train", "--resume", run.id, "--detach", "--runs-dir", str(manager.runs_dir),
                           "--backend", "cpu")
        assert queued.returncode == 0, queued.stderr
        assert f"Run {run.id} queued to resume from step 1, 1st of 1: waits for 1 free cpu core(s)" in queued.stdout
        view = manager.view(run.id)
        assert view.live_state == "queued" and HOLDER in view.where()
        assert (view.ended, view.training_seconds(), view.attempts) == before[2:]  # the wait is no attempt
        with pytest.raises(SpecError, match="is queued"):  # one resume at a time
            manager.resume(run.id, hardware, queue_if_busy=True)

        cancelled = launch_py("stop", run.id, "--runs-dir", str(manager.runs_dir))
        assert cancelled.stdout.strip() == f"Run {run.id}: stopped (cancelled while queued)", cancelled.stderr
        view = manager.view(run.id)  # as it was: same state, reason, end, training time and attempts
        assert (view.live_state, view.reason, view.ended, view.training_seconds(), view.attempts) == before
        assert queue.queued(manager.runs_dir) == [] and view.resume_point()["step"] == 1
        assert "the resume from step 1 was cancelled while queued" in (view.dir / "events.jsonl").read_text()

        assert manager.resume(run.id, hardware, queue_if_busy=True).live_state == "queued"
        wait_for(lambda: runners(manager.runs_dir), "a queue runner")
    finally:
        freed = time.time()
        lease.release()
    resumed = manager.wait(run.id)  # the runner resumes it once a core is free
    assert resumed.live_state == "finished" and resumed.attempts == 2, resumed.error_text
    steps = [e["step"] for e in events.read(resumed.dir / "events.jsonl") if e["type"] == "progress"]
    assert steps[-5:] == [2, 3, 4, 5, 6]  # it went on from the checkpoint at step 1
    assert resumed.resumed_from().endswith("checkpoint-1")
    assert resumed.spans[0].end == before[2] and resumed.spans[1].begin >= freed  # its attempt: from its start
    assert resumed.training_seconds() == pytest.approx(sum(span.seconds() for span in resumed.spans))
    wait_for(lambda: not runners(manager.runs_dir), "the runner to exit with the queue empty")


@pytest.mark.fast
def test_a_queued_resume_begins_its_attempt_when_it_starts_and_a_cancel_ends_nothing_new():
    at = [("starting", 0), ("running", 5), ("stopped", 60)]
    ran = [{**events.status(state), "time": T0 + t} for state, t in at]
    queued, cancelled = {**events.status("queued"), "time": T0 + 100}, {**events.status("stopped"), "time": T0 + 150}
    state = fold([*ran, queued, {**events.log("a note while it waits"), "time": T0 + 120}, cancelled])
    assert (state.state, state.ended, len(state.spans), state.attempts) == ("stopped", T0 + 60, 1, 1)
    resume = {**events.resume(1, "output/checkpoint-1"), "time": T0 + 300}
    state = fold([*ran, queued, cancelled, {**queued, "time": T0 + 200}, resume,
                  {**events.status("starting"), "time": T0 + 300}, {**events.status("finished"), "time": T0 + 400}])
    assert [(span.begin - T0, span.end - T0) for span in state.spans] == [(0, 60), (300, 400)]
    assert (state.state, state.ended, state.attempts) == ("finished", T0 + 400, 2)


@pytest.mark.fast
def test_a_queued_run_has_begun_no_attempt_until_it_starts():
    queued_at = events.status("queued")
    state = fold([queued_at, {**events.log("warning: a plan warning"), "time": queued_at["time"] + 1}])
    assert state.state == "queued" and state.spans == []
    state.apply({**events.status("starting"), "time": queued_at["time"] + 60})
    assert state.spans[0].begin == queued_at["time"] + 60
    cancelled = fold([queued_at, {**events.status("stopped", reason=queue.CANCELLED), "time": queued_at["time"] + 5}])
    assert cancelled.state == "stopped" and cancelled.spans[0].seconds() == 0


@pytest.mark.fast
def test_places_read_as_people_say_them():
    assert [queue.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th"]


def test_the_manager_without_the_queue_still_refuses_busy_cores(manager, held):
    with pytest.raises(SpecError, match=f"held \\({HOLDER}"):
        manager.start(tiny("max_steps=3"), cpu_hardware())
    assert queue.queued(manager.runs_dir) == [] and RunManager(manager.runs_dir).list() == []
