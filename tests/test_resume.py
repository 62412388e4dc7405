"""Checkpoints, stop and save, and resume: nothing is lost when a run stops or fails.

Real torchrun runs of the tiny model; a resumed run is compared with an uninterrupted run
of the same seed: same weights, same optimizer state, same loss.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import pytest

from cli.main import main as cli_main
from conftest import launch_py
from studio_core.machine.hardware import cpu_hardware
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import SpecError
from test_runs import LONG, marked_processes, ranks, tiny

SAVED = ["max_steps=30", "logging_steps=5", "save_strategy=steps", "save_steps=30"]


def run_events(view) -> list[dict]:
    return [json.loads(line) for line in (view.dir / "events.jsonl").read_text().splitlines()]


def progress_steps(view, since_resume: bool = False) -> list[int]:
    events = run_events(view)
    if since_resume:
        events = events[max(i for i, e in enumerate(events) if e["type"] == "resume"):]
    return [e["step"] for e in events if e["type"] == "progress"]


def times(view) -> tuple:
    return view.first_start, view.training_seconds(), view.wall_seconds()


def test_stop_and_save_then_resume_matches_an_uninterrupted_run(manager):
    import torch

    hardware = cpu_hardware()
    straight = manager.wait(manager.start(tiny(*SAVED), hardware).id)
    assert straight.live_state == "finished", straight.error_text

    # asked before training begins, the stop lands on the first step: a checkpoint, then a stop
    run = manager.start(tiny(*SAVED), hardware)
    manager.stop_and_save(run.id)
    stopped = manager.wait(run.id)
    assert stopped.live_state == "stopped" and stopped.step == 1
    first_start, stop_time, trained = stopped.first_start, stopped.ended, stopped.training_seconds()
    assert first_start == run_events(stopped)[0]["time"] and trained == pytest.approx(stopped.wall_seconds())
    assert [c["step"] for c in stopped.checkpoints] == [1] and stopped.resume_point()["step"] == 1
    assert not (stopped.dir / "output" / "model.safetensors").exists()  # stopped, not finished

    resumed = manager.wait(manager.resume(run.id, hardware).id)
    assert resumed.live_state == "finished", resumed.error_text
    # its times: the first start stays, the time it stood stopped is in the wall time only
    idle = next(e["time"] for e in run_events(resumed) if e["type"] == "resume") - stop_time
    assert resumed.first_start == first_start and idle > 0
    assert resumed.training_seconds() > trained and resumed.duration() == resumed.training_seconds()
    assert resumed.wall_seconds() - resumed.training_seconds() == pytest.approx(idle)
    assert times(RunManager(manager.runs_dir).view(run.id)) == times(resumed)  # after an app restart
    steps = progress_steps(resumed)
    assert steps[:2] == [1, 2] and steps[-1] == 30  # the step count went on from the checkpoint
    from safetensors.torch import load_file  # here, not at the top: collecting the tests imports no torch

    ours, theirs = (load_file(v.dir / "output" / "model.safetensors") for v in (resumed, straight))
    assert all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in theirs)
    optimizers = [torch.load(v.dir / "output" / "checkpoint-30" / "optimizer.pt", weights_only=False)
                  for v in (resumed, straight)]
    for key, state in optimizers[1]["state"].items():
        assert torch.allclose(optimizers[0]["state"][key]["exp_avg_sq"], state["exp_avg_sq"], atol=1e-9)
    loss = [next(m["loss"] for m in v.metrics if m.get("step") == 30 and "loss" in m) for v in (resumed, straight)]
    assert loss[0] == pytest.approx(loss[1], abs=1e-4)


def test_a_failed_run_says_from_where_it_can_resume_and_does(manager):
    hardware = cpu_hardware()
    run = manager.start(tiny(*LONG, "save_strategy=steps", "save_steps=20"), hardware)
    manager.wait(run.id, lambda v: len(v.checkpoints) >= 1)  # a checkpoint
    ranks(marked_processes(run.id))["0"].send_signal(signal.SIGKILL)
    failed = manager.wait(run.id)
    assert failed.live_state == "failed"
    point = failed.resume_point()
    assert point and point["step"] % 20 == 0 and point["size_bytes"] > 0
    # kept before the resume: `failed` is the manager's view of the run, which the resume goes on updating
    first_start, failed_at, trained = failed.first_start, failed.ended, failed.training_seconds()
    resumed = manager.resume(run.id, hardware)
    view = manager.wait(run.id, lambda v: v.step >= point["step"] + 3)  # steps after the checkpoint
    assert view.live_state == "running"
    # going: the training time counts this attempt up to now, not the time between the failure and the resume
    idle = next(e["time"] for e in run_events(view) if e["type"] == "resume") - failed_at
    assert view.first_start == first_start and view.training_seconds() > trained and idle > 0
    assert view.wall_seconds() - view.training_seconds() == pytest.approx(idle, abs=0.5)
    assert view.wall_seconds() == pytest.approx(time.time() - first_start, abs=0.5)  # up to now
    assert progress_steps(view, since_resume=True)[:3] == [point["step"] + 1, point["step"] + 2, point["step"] + 3]
    assert all(m["step"] <= point["step"] or m["time"] > failed.ended for m in view.metrics)
    with pytest.raises(SpecError, match="is running"):
        manager.resume(resumed.id, hardware)
    manager.stop(run.id)


def test_resume_refusals_say_what_to_change(manager, sft_runs):
    run = sft_runs.copy_to(manager.runs_dir, "full").view(sft_runs.ids["full"])  # finished, saved no checkpoint
    assert run.live_state == "finished" and run.saved_checkpoints() == []
    with pytest.raises(SpecError, match="saved no checkpoint"):
        manager.resume(run.id, cpu_hardware())
    done = launch_py("train", "--resume", run.id, "--runs-dir", str(manager.runs_dir), "--backend", "cpu")
    assert done.returncode == 2 and "saved no checkpoint" in done.stderr
    saved = manager.wait(manager.start(tiny("max_steps=10", "save_strategy=steps", "save_steps=5"), cpu_hardware()).id)
    wrong = launch_py("train", "--resume", saved.id, "--from-checkpoint", "7", "--runs-dir", str(manager.runs_dir),
                      "--backend", "cpu")
    assert wrong.returncode == 2 and "has steps 5, 10" in wrong.stderr
    # (a resume from a chosen checkpoint, followed without replay: README's, in tests/test_readme.py)


# --- a resumed run's times, from event files written here ------------------------------------
T0 = 1_767_000_000.0  # the first start of the runs below


def write_run(runs_dir, run_id: str, events: list[tuple[str, float, dict]] | None, extra_lines: str = "") -> None:
    """A run folder: its spec, and its events (type, seconds after T0, fields); None: no events file."""
    run_dir = runs_dir / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "spec.yaml").write_text("studio: {trainer: sft}\nmodel_name_or_path: /models/base/my-model\n"
                                       "dataset_name: trl-lib/Capybara\n")
    if events is not None:
        lines = [json.dumps({"type": kind, "time": T0 + at, **fields}) for kind, at, fields in events]
        (run_dir / "events.jsonl").write_text("\n".join(lines) + "\n" + extra_lines)


def sample(cpu: float) -> dict:
    return {"cpu_percent": cpu, "rss_bytes": 2**30, "processes": 2}


RESUMED = [("status", 0, {"state": "starting"}), ("hardware", 2, sample(50)), ("status", 5, {"state": "running"}),
           ("hardware", 10, sample(90)), ("saved_stop", 59, {"step": 1}), ("status", 60, {"state": "stopped"}),
           ("log", 70, {"message": "after its end: no part of its time"}),
           ("resume", 1000, {"step": 1, "checkpoint": "output/checkpoint-1"}), ("status", 1000, {"state": "starting"}),
           ("hardware", 1002, sample(40)), ("status", 1005, {"state": "running"}), ("hardware", 1010, sample(95)),
           ("status", 1030, {"state": "finished"})]


@pytest.mark.fast
def test_a_resumed_runs_times_leave_out_the_idle_gap_everywhere(tmp_path, capsys):
    import gradio as gr

    from app import hardware_panel
    from app.runs_tab import runs_table
    from studio_core.runs.view import format_time

    run_id = "20260101-120000-tiny-sft-abc123"
    write_run(tmp_path / "runs", run_id, RESUMED, extra_lines='{"type": "status"}\nnot json\n')
    os.utime(tmp_path / "runs" / run_id / "spec.yaml", (T0 + 1000, T0 + 1000))  # a file's time is no start
    view = RunManager(tmp_path / "runs").view(run_id)
    assert times(view) == (T0, 90, 1030) and view.duration() == 90 and view.live_state == "finished"
    assert times(RunManager(tmp_path / "runs").view(run_id)) == times(view)  # after an app restart
    assert [view.training_time_at(T0 + at) for at in (-5, 0, 10, 60, 500, 1000, 1010, 2000)] == \
        [0, 0, 10, 60, 60, 60, 70, 90]  # a moment in the gap counts as its start's end

    (row,) = runs_table([view]).to_dict("records")
    assert row["started"] == format_time(T0) and (row["training"], row["wall"]) == ("1:30", "17:10")
    assert (row["state · steps"], row["model"], row["dataset"]) == ("finished 1/?", "my-model", "trl-lib/Capybara")
    assert cli_main(["runs", "--runs-dir", str(tmp_path / "runs")]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(run_id)]
    assert f"{format_time(T0)}     1:30    17:10  /models/base/my-model" in line

    with gr.Blocks():
        panel = hardware_panel.HardwarePanel()
    shown = panel.render(view)
    cpu = shown[panel.cpu]
    # every attempt's samples after the one before's, in training time; one row without a value breaks the line
    assert list(cpu["seconds"]) == [2, 10, 36, 62, 70]
    assert [math.isnan(value) for value in cpu["cpu_percent"]] == [False, False, True, False, False]
    assert "training time" in panel.cpu.x_title and "2 attempts" in shown[panel.note]


@pytest.mark.fast
def test_a_run_with_missing_or_broken_events_still_has_what_times_it_can(tmp_path):
    from app.runs_tab import runs_table

    runs = tmp_path / "runs"
    write_run(runs, "20260101-120000-tiny-sft-abc123", RESUMED)
    write_run(runs, "20260102-090000-no-events-aaaaaa", None)  # events.jsonl missing
    write_run(runs, "renamed-run", [], extra_lines="not json\n")  # no time anywhere
    write_run(runs, "20260103-090000-lost-bbbbbb", RESUMED[:4])  # its processes died without a word
    write_run(runs, "20260104-090000-lost-then-resumed-cccccc", RESUMED[:4] + RESUMED[7:])
    views = {view.id: view for view in RunManager(runs).list()}
    assert times(views["20260101-120000-tiny-sft-abc123"]) == (T0, 90, 1030)  # the sound one as ever
    assert times(views["20260102-090000-no-events-aaaaaa"]) == (time.mktime((2026, 1, 2, 9, 0, 0, 0, 0, -1)),
                                                                None, None)
    assert times(views["renamed-run"]) == (None, None, None) and views["renamed-run"].created == 0
    lost = views["20260103-090000-lost-bbbbbb"]
    assert lost.live_state == "failed" and times(lost) == (T0, 10, 10)  # up to its last sign of life
    assert times(views["20260104-090000-lost-then-resumed-cccccc"]) == (T0, 10 + 30, 1030)
    rows = {row["run"]: row for row in runs_table(list(views.values())).to_dict("records")}
    assert set(rows) == set(views)
    assert (rows["renamed-run"]["started"], rows["renamed-run"]["training"], rows["renamed-run"]["wall"]) == ("",) * 3
