"""A queued resume's message ("... queued to resume ... Stop cancels it") does not outlive the wait:
once the run leaves the queue, the page says it resumed (issue 47). A real run of the tiny model,
stopped with a checkpoint, resumed while a lease taken here holds both CPU cores."""

from __future__ import annotations

import gradio as gr

from app import run_panel
from studio_core.machine import leases
from studio_core.machine.hardware import cpu_hardware
from test_runs import tiny


def test_a_queued_resume_says_it_resumed_once_it_leaves_the_queue(manager):
    hardware = cpu_hardware()
    run = manager.start(tiny("max_steps=6", "save_strategy=steps", "save_steps=6"), hardware)
    manager.stop_and_save(run.id)  # a checkpoint at step 1, then a stop
    assert manager.wait(run.id).live_state == "stopped"
    with gr.Blocks() as demo:
        run_id, message = gr.State(run.id), gr.Markdown("")
        controls = run_panel.RunControls()
        controls.wire(manager, hardware, run_id, message)
    [resume] = [f for f in demo.fns.values() if (controls.resume._id, "click") in f.targets]
    [waits] = [f for f in demo.fns.values() if f.trigger_after == resume._id]
    [tick] = [f for f in demo.fns.values() if f.targets and f.targets[0][1] == "tick"]
    with leases.acquire(manager.runs_dir, "cpu", [0, 1], holder="chat-holding-both", kind="chat"):
        said = resume.fn(run.id)
        assert "queued to resume from step 1" in said and said.endswith("Stop cancels it."), said
        waited, timer = waits.fn(run.id)
        assert waited == run.id and timer.active
        assert tick.fn(waited, said) == (gr.update(), gr.update())  # still queued: said as it was
    # resumed: between leaving the queue and its "starting" event the run still reads as it was (stopped)
    view = manager.wait(run.id, lambda v: v.live_state in ("starting", "running", "finished", "failed"), timeout=120)
    try:
        text, timer = tick.fn(waited, said)
        assert text.startswith(f"Run `{run.id}` resumed from step 1") and not timer.active, text
        assert "Stop cancels it" not in text and "queued" not in text
        _, timer = tick.fn(waited, "Something else said since.")  # another message: kept, the look ends
        assert not timer.active
    finally:
        manager.stop(view.id)


def test_a_queued_runs_progress_says_queued_not_step_0_of_unknown(manager):
    hardware = cpu_hardware()
    with leases.acquire(manager.runs_dir, "cpu", [0, 1], holder="chat-holding-both", kind="chat"):
        view = manager.start(tiny("max_steps=3"), hardware, queue_if_busy=True)
        try:
            assert view.live_state == "queued"
            shown = run_panel.progress_html(manager.view(view.id))
            assert "queued: it starts when its cores are free" in shown and "step 0 / ?" not in shown
        finally:
            manager.stop(view.id)  # cancelled while queued: it never starts
    assert manager.view(view.id).live_state != "queued"
