"""A queued run's message ("... queued to resume ... Stop cancels it", Start's "Queued run ... Stop
cancels it") does not outlive the wait: once the run leaves the queue, the page says it resumed or
started (issue 47), never "stopped" while its processes are not there yet. Real runs of the tiny
model, queued while a lease taken here holds both CPU cores."""

from __future__ import annotations


from studio_core.machine import leases
from studio_core.machine.hardware import cpu_hardware
from test_runs import tiny


def test_a_queued_resume_says_it_resumed_once_it_leaves_the_queue(manager):
    import gradio as gr
    from app import run_panel

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
        waited, timer = waits.fn(run.id, said)
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
    from app import run_panel

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


def test_a_queued_resume_leaving_the_queue_is_never_said_to_be_stopped(manager):
    """Issue 47: a look that came between the run leaving the queue and its processes starting said
    "left the queue: it is stopped" (the run reads as its last attempt ended until its supervisor
    is there). The queue runner's steps up to its submit, done here under its lock: the run's
    events say it resumes and starts, its place is gone, no process of it is there yet."""
    import gradio as gr
    from app import run_panel

    from studio_core.rundir import events, folder
    from studio_core.runs import queue

    hardware = cpu_hardware()
    run = manager.start(tiny("max_steps=6", "save_strategy=steps", "save_steps=6"), hardware)
    manager.stop_and_save(run.id)
    assert manager.wait(run.id).live_state == "stopped"
    with gr.Blocks() as demo:
        run_id, message = gr.State(run.id), gr.Markdown("")
        controls = run_panel.RunControls()
        controls.wire(manager, hardware, run_id, message)
    [resume] = [f for f in demo.fns.values() if (controls.resume._id, "click") in f.targets]
    [tick] = [f for f in demo.fns.values() if f.targets and f.targets[0][1] == "tick"]
    with leases.acquire(manager.runs_dir, "cpu", [0, 1], holder="chat-holding-both", kind="chat"):
        said = resume.fn(run.id)
        assert said.endswith("Stop cancels it."), said
        with leases.choosing(manager.runs_dir):  # as RunManager.start_queued, before it submits the run
            chosen = queue.resume_of(run.dir)
            events.append(run.dir / folder.EVENTS, events.resume(chosen["step"], chosen["path"]))
            events.append(run.dir / folder.EVENTS, events.status("starting"))
            queue.leave(run.dir)
    view = manager.view(run.id)
    # its events say so, and the last attempt's ended.json and supervisor.json do not make it read as stopped
    assert view.state == "starting" and view.live_state == "starting" and view.error_text is None
    text, timer = tick.fn(run.id, said)
    assert text.startswith(f"Run `{run.id}` resumed from step 1") and not timer.active, text
    assert "stopped" not in text


def test_a_queued_start_says_it_started_once_it_leaves_the_queue(manager):
    """Start's "Queued run X ... Stop cancels it." becomes "left the queue and started", not a resume."""
    import gradio as gr
    from app import run_panel

    hardware = cpu_hardware()
    with gr.Blocks() as demo:
        run_id, message = gr.State(None), gr.Markdown("")
        controls = run_panel.RunControls()
        controls.wire(manager, hardware, run_id, message)
    [tick] = [f for f in demo.fns.values() if f.targets and f.targets[0][1] == "tick"]
    with leases.acquire(manager.runs_dir, "cpu", [0, 1], holder="chat-holding-both", kind="chat"):
        view = manager.start(tiny("max_steps=3"), hardware, queue_if_busy=True)
        said = f"Queued run `{view.id}` ({view.where()}). It starts when its cores are free; {run_panel.CANCELS}"
        assert tick.fn(view.id, said) == (gr.update(), gr.update())
    manager.wait(view.id, lambda v: v.live_state != "queued", timeout=120)
    try:
        text, timer = tick.fn(view.id, said)
        assert text.startswith(f"Run `{view.id}` left the queue and started.") and not timer.active, text
    finally:
        manager.stop(view.id)
