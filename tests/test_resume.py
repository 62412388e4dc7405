"""Checkpoints, stop and save, and resume: nothing is lost when a run stops or fails.

Real torchrun runs of the tiny model; a resumed run is compared with an uninterrupted run
of the same seed: same weights, same optimizer state, same loss.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch
from safetensors.torch import load_file

from studio_core.hardware import cpu_hardware
from studio_core.spec import SpecError
from test_runs import LONG, launch_py, marked_processes, ranks, tiny

SAVED = ["max_steps=30", "logging_steps=5", "save_strategy=steps", "save_steps=30"]


def progress_steps(view, since_resume: bool = False) -> list[int]:
    events = [json.loads(line) for line in (view.dir / "events.jsonl").read_text().splitlines()]
    if since_resume:
        events = events[max(i for i, e in enumerate(events) if e["type"] == "resume"):]
    return [e["step"] for e in events if e["type"] == "progress"]


def test_stop_and_save_then_resume_matches_an_uninterrupted_run(manager):
    hardware = cpu_hardware()
    straight = manager.wait(manager.start(tiny(*SAVED), hardware).id)
    assert straight.live_state == "finished", straight.error_text

    # asked before training begins, the stop lands on the first step: a checkpoint, then a stop
    run = manager.start(tiny(*SAVED), hardware)
    manager.stop_and_save(run.id)
    stopped = manager.wait(run.id)
    assert stopped.live_state == "stopped" and stopped.step == 1
    assert [c["step"] for c in stopped.checkpoints] == [1] and stopped.resume_point()["step"] == 1
    assert not (stopped.dir / "output" / "model.safetensors").exists()  # stopped, not finished

    resumed = manager.wait(manager.resume(run.id, hardware).id)
    assert resumed.live_state == "finished", resumed.error_text
    steps = progress_steps(resumed)
    assert steps[:2] == [1, 2] and steps[-1] == 30  # the step count went on from the checkpoint
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
    resumed = manager.resume(run.id, hardware)
    view = manager.wait(run.id, lambda v: v.step >= point["step"] + 3)  # steps after the checkpoint
    assert view.live_state == "running"
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
    again = launch_py("train", "--resume", saved.id, "--from-checkpoint", "5", "--runs-dir", str(manager.runs_dir),
                      "--backend", "cpu")
    assert again.returncode == 0, again.stderr
    assert progress_steps(manager.wait(saved.id), since_resume=True) == [6, 7, 8, 9, 10]
    printed = [line.split()[1] for line in again.stdout.splitlines() if line.startswith("step ")]
    assert printed and all(int(step) > 5 for step in printed), again.stdout  # no replay of what came before
